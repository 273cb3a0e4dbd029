"""The core process: owns the ZMQ sockets around the in-process EngineCore."""

from __future__ import annotations

import time

import zmq

from gapless.core.common.channel import Receiver, Sender
from gapless.core.common.config import EngineConfig
from gapless.core.common.messages import (
    HEARTBEAT_INTERVAL_S,
    CoreInput,
    DetokInput,
    FrontendInput,
    Heartbeat,
    RunnerError,
    RunnerInput,
    RunnerOutput,
    RunnerReady,
    StepResult,
)
from gapless.core.common.process import (
    CORE_IN,
    DETOK_IN,
    RUNNER_IN,
    RUNNER_OUT,
    ControlReporter,
    frontend_socket,
    stop_requested,
)
from gapless.core.engine import EngineCore, EngineOutputs

IDLE_POLL_MS = 100  # how long to block with nothing to do before looking at stop_requested()


class CoreProcess:
    """Moves messages between the sockets and the EngineCore; no scheduling logic here."""

    def __init__(self, core: EngineCore, ctx: zmq.Context, results: Receiver[RunnerOutput]) -> None:
        config = core.config
        self.core = core
        self.inbox: Receiver[CoreInput] = Receiver(ctx, config.ipc(CORE_IN), CoreInput)
        self.results = results
        self.runner: Sender[RunnerInput] = Sender(ctx, config.ipc(RUNNER_IN), shm=True)
        self.detok: Sender[DetokInput] = Sender(ctx, config.ipc(DETOK_IN), shm=True)
        self.frontends: list[Sender[FrontendInput]] = [
            Sender(ctx, config.ipc(frontend_socket(i))) for i in range(config.api_servers)
        ]

    def send(self, out: EngineOutputs) -> None:
        for plan in out.plans:
            self.runner.send(plan)
        for msg in out.detok:
            self.detok.send(msg)
        for fid, reply in out.frontend:
            self.frontends[fid].send(reply)

    def run(self) -> None:
        core, poller = self.core, zmq.Poller()
        poller.register(self.inbox.socket, zmq.POLLIN)
        poller.register(self.results.socket, zmq.POLLIN)
        result: StepResult | None = None
        beat_at = 0.0  # time.monotonic() of the last Heartbeat
        while not core.shutdown and not stop_requested():
            now = time.monotonic()
            if now - beat_at >= HEARTBEAT_INTERVAL_S:
                beat_at = now
                for frontend in self.frontends:
                    frontend.send(Heartbeat())
            # 1. drain inputs without blocking
            for msg in self.inbox.drain():
                core.handle(msg)
            # 2. apply the result that came, plan ahead, send what that produced
            self.send(core.step(result))
            result = None
            # 3. wait for the oldest step's result, or for input while idle
            events = dict(poller.poll(IDLE_POLL_MS))
            if self.results.socket in events:
                # timeout 0: a stray frame was dropped, and nothing else may have come
                match self.results.recv(timeout_ms=0):
                    case StepResult() as result:
                        pass
                    case RunnerError(message=message):
                        raise RuntimeError(f"gpu_runner failed: {message}")
        core.timeline.close()


def run_core(config: EngineConfig) -> None:
    """Process entry of the core: waits for the runner's capacity, then schedules forever."""
    ctx = zmq.Context()
    control = ControlReporter(ctx, config, "core")
    results: Receiver[RunnerOutput] = Receiver(ctx, config.ipc(RUNNER_OUT), RunnerOutput)
    try:
        ready = None
        while ready is None and not stop_requested():
            msg = results.recv(timeout_ms=IDLE_POLL_MS)
            if isinstance(msg, RunnerReady):
                ready = msg
        if ready is None:
            return
        process = CoreProcess(EngineCore(config, ready.num_kv_blocks), ctx, results)
        control.ready(num_kv_blocks=ready.num_kv_blocks)
        process.run()
    except Exception as e:  # reported, then the supervisor ends the engine
        control.fatal(f"{type(e).__name__}: {e}")
        time.sleep(0.2)
        raise
    finally:
        control.close()
        ctx.destroy(linger=0)
