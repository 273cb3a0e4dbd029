"""Entry of the detokenizer process: TokenBatch in, TextDeltas out, StreamEnded to the core."""

from __future__ import annotations

import time

import zmq
from tokenizers import Tokenizer

from gapless.common import model_files
from gapless.common.channel import Receiver, Sender
from gapless.common.config import EngineConfig, ModelInfo
from gapless.common.messages import (
    CoreInput,
    DetokInput,
    DetokNew,
    FrontendInput,
    Shutdown,
    StreamEnded,
    TextDeltas,
    TokenBatch,
)
from gapless.common.metrics import DetokenizerMetrics
from gapless.common.process import (
    CORE_IN,
    DETOK_IN,
    ControlReporter,
    frontend_socket,
    stop_requested,
)
from gapless.detokenizer.state import DetokenizerState, Outbox

IDLE_POLL_MS = 100  # how long to block when idle before looking at stop_requested() again


def load_tokenizer(info: ModelInfo) -> Tokenizer:
    return model_files.load_tokenizer(info)


def run_detokenizer(config: EngineConfig) -> None:
    """Run the detokenizer until a Shutdown message or SIGTERM / parent death.

    Binds DETOK_IN, connects to every frontend's socket and to CORE_IN, reports READY, then per
    pass: block (up to IDLE_POLL_MS) for a first message, drain the rest, process them in order,
    and send one TextDeltas per frontend that has deltas, then StreamEnded to the core.
    """
    ctx = zmq.Context()
    reporter = ControlReporter(ctx, config, "detokenizer")
    try:
        _serve(ctx, config, reporter)
    except Exception as e:
        reporter.fatal(f"detokenizer: {type(e).__name__}: {e}")
        raise
    finally:
        reporter.close()
        ctx.term()


def _serve(ctx: zmq.Context, config: EngineConfig, reporter: ControlReporter) -> None:
    state = DetokenizerState(load_tokenizer(config.model), config.api_servers)
    inbox: Receiver[DetokInput] = Receiver(ctx, config.engine_ipc(DETOK_IN), DetokInput)
    frontends: list[Sender[FrontendInput]] = [
        Sender(ctx, config.ipc(frontend_socket(i))) for i in range(config.api_servers)
    ]
    core: Sender[CoreInput] = Sender(ctx, config.engine_ipc(CORE_IN))
    detokenize = DetokenizerMetrics().detokenize
    reporter.ready()
    try:
        running = True
        while running and not stop_requested():
            # 1. block only when idle, then drain everything already waiting
            first = inbox.recv(IDLE_POLL_MS)
            if first is None:
                continue
            out = Outbox()
            # 2. process in arrival order: a DetokNew precedes its request's tokens
            for msg in [first, *inbox.drain()]:
                match msg:
                    case TokenBatch():
                        t0 = time.perf_counter()
                        state.process(msg, out)
                        detokenize.observe(time.perf_counter() - t0)
                    case DetokNew():
                        state.add(msg, out)
                    case Shutdown():
                        running = False
            # 3. publish: one message per frontend, then what the core must act on
            _publish(out, frontends, core)
    finally:
        inbox.close()
        for sender in frontends:
            sender.close()
        core.close()


def _publish(out: Outbox, frontends: list[Sender[FrontendInput]], core: Sender[CoreInput]) -> None:
    for frontend_id, deltas in out.deltas.items():
        frontends[frontend_id].send(TextDeltas(deltas))
    if out.stop_hits:
        core.send(StreamEnded(out.stop_hits, "stop"))
    if out.failed:
        core.send(StreamEnded(out.failed, "error"))
