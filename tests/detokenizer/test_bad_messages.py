"""The detokenizer's process loop given well-typed but impossible messages from the core: a
DetokNew for a frontend that does not exist or with ids outside the vocabulary, a TokenBatch
whose lists do not line up, an end reason the core never sends. Each is counted, its requests
end with an error (the core is told), and the loop goes on serving the others."""

from __future__ import annotations

import threading
import time

import msgspec
import zmq
from prometheus_client import REGISTRY

from gapless.common.channel import Receiver, Sender
from gapless.common.config import EngineConfig, ModelInfo
from gapless.common.messages import (
    ControlMessage,
    CoreInput,
    DetokInput,
    FrontendInput,
    Ready,
    Shutdown,
    StreamEnded,
    TextDelta,
    TextDeltas,
)
from gapless.common.process import CONTROL, CORE_IN, DETOK_IN, frontend_socket
from gapless.detokenizer import process
from gapless.detokenizer.state import DetokenizerState
from tests.detokenizer.util import make_batch, make_new

MODEL = ModelInfo(
    path="unused", architecture="llama", vocab_size=49152, max_model_len=8192, eos_token_ids=(2,)
)


def _bad(reason: str) -> float:
    labels = {"process": "detokenizer", "reason": reason}
    return REGISTRY.get_sample_value("gapless_bad_messages_total", labels) or 0.0


def _collect(frontend: Receiver, until: set[str], seconds: float = 10) -> dict[str, TextDelta]:
    """The last delta of each request in until, once each has ended."""
    got: dict[str, TextDelta] = {}
    deadline = time.monotonic() + seconds
    while not until <= {rid for rid, d in got.items() if d.finish_reason}:
        assert time.monotonic() < deadline, got
        msg = frontend.recv(timeout_ms=50)
        if isinstance(msg, TextDeltas):
            got.update((d.request_id, d) for d in msg.deltas)
    return got


def test_impossible_messages_end_their_requests_and_the_loop_goes_on(
    tokenizer, tmp_path, monkeypatch
):
    monkeypatch.setattr(process, "load_tokenizer", lambda info: tokenizer)
    config = EngineConfig(model=MODEL, served_model_name="x", run_dir=str(tmp_path))
    ctx = zmq.Context()
    control = Receiver(ctx, config.ipc(CONTROL), ControlMessage)
    core = Receiver(ctx, config.ipc(CORE_IN), CoreInput)
    frontend = Receiver(ctx, config.ipc(frontend_socket(0)), FrontendInput)
    to_detok: Sender[DetokInput] = Sender(ctx, config.ipc(DETOK_IN))
    thread = threading.Thread(target=process.run_detokenizer, args=(config,), daemon=True)
    thread.start()
    before = {r: _bad(r) for r in ("detok_new", "token_batch", "end_reason")}
    ids = tokenizer.encode("still here").ids
    try:
        ready = control.recv(timeout_ms=10_000)
        assert isinstance(ready, Ready) and ready.role == "detokenizer"
        # before: frontends[7] was an IndexError, and a negative id an OverflowError
        to_detok.send(make_new("no-frontend", frontend_id=7))
        to_detok.send(make_new("bad-tail", prompt_tail=[-5, 10]))
        to_detok.send(make_new("odd-end"))
        to_detok.send(make_new("misaligned"))
        to_detok.send(make_new("ok"))
        misaligned = make_batch([("misaligned", ids, "")])
        misaligned.counts.append(1)  # more counts than entries: was an IndexError
        to_detok.send(misaligned)
        to_detok.send(make_batch([("odd-end", ids, "exploded"), ("ok", ids, "")]))
        to_detok.send(make_batch([("ok", [2], "stop_token"), ("bad-tail", ids, "")]))

        got = _collect(frontend, {"bad-tail", "odd-end", "misaligned", "ok"})
        assert got["ok"].finish_reason == "stop" and got["ok"].error is None
        assert got["bad-tail"].finish_reason == "error"
        assert got["odd-end"].finish_reason == "error"
        assert got["misaligned"].finish_reason == "error"
        ended: list[str] = []
        while (msg := core.recv(timeout_ms=1_000)) is not None:
            assert isinstance(msg, StreamEnded) and msg.reason == "error", msg
            ended += msg.request_ids
        assert sorted(ended) == ["bad-tail", "misaligned", "no-frontend"], "the core ends them"
        assert {r: _bad(r) - n for r, n in before.items()} == {
            "detok_new": 2, "token_batch": 1, "end_reason": 1,
        }  # fmt: skip
        to_detok.send(Shutdown())
        thread.join(timeout=5)
        assert not thread.is_alive(), "the loop ran until it was told to stop"
    finally:
        for socket in (control, core, frontend, to_detok):
            socket.close()
        ctx.term()


def test_lists_of_a_batch_line_up_only_when_each_has_one_item_per_entry() -> None:
    batch = make_batch([("a", [5, 6], ""), ("b", [7], "length")], errors=["", ""])
    assert DetokenizerState._lines_up(batch)
    for field, value in [
        ("finish_reasons", [""]),
        ("num_prompt_tokens", [1, 2, 3]),
        ("errors", [""]),
        ("num_cached_tokens", [0]),
        ("prompt_logprobs", [None]),
        ("logprobs", [None, None]),
    ]:
        assert not DetokenizerState._lines_up(msgspec.structs.replace(batch, **{field: value}))
