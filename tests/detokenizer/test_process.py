from __future__ import annotations

import threading
import time

import zmq

from gapless.common.channel import Receiver, Sender
from gapless.common.config import EngineConfig, ModelInfo
from gapless.common.messages import (
    ControlMessage,
    CoreInput,
    DetokInput,
    FrontendInput,
    Ready,
    SampleLogprobs,
    Shutdown,
    StreamEnded,
    TextDeltas,
)
from gapless.common.process import CONTROL, CORE_IN, DETOK_IN, frontend_socket
from gapless.detokenizer import process
from tests.detokenizer.util import EOS, lp, make_batch, make_new

MODEL = ModelInfo(
    path="unused", architecture="llama", vocab_size=49152, max_model_len=8192, eos_token_ids=(2,)
)


def test_process_round_trip(tokenizer, tmp_path, monkeypatch):
    monkeypatch.setattr(process, "load_tokenizer", lambda info: tokenizer)
    config = EngineConfig(model=MODEL, served_model_name="x", run_dir=str(tmp_path), api_servers=2)
    ctx = zmq.Context()
    control = Receiver(ctx, config.ipc(CONTROL), ControlMessage)
    core = Receiver(ctx, config.ipc(CORE_IN), CoreInput)
    frontends = [Receiver(ctx, config.ipc(frontend_socket(i)), FrontendInput) for i in (0, 1)]
    to_detok: Sender[DetokInput] = Sender(ctx, config.ipc(DETOK_IN))
    thread = threading.Thread(target=process.run_detokenizer, args=(config,), daemon=True)
    thread.start()
    try:
        ready = control.recv(timeout_ms=10_000)
        assert isinstance(ready, Ready) and ready.role == "detokenizer"

        to_detok.send(make_new("a", frontend_id=0, stop=("STOP",)))
        to_detok.send(make_new("b", frontend_id=1))
        to_detok.send(make_new("c", frontend_id=1, logprobs=2))
        ids = tokenizer.encode("go STOP now").ids
        n = len(ids)
        # "c" gets a malformed top list (2 ids, 1 logprob): detokenizing it fails
        broken = SampleLogprobs(-1.0, [1, 2], [-1.0])
        to_detok.send(
            make_batch(
                [("a", ids, ""), ("b", ids, ""), ("c", ids, "")],
                logprobs=[None] * (2 * n) + [broken] * n,
            )
        )
        # steps the core already had in flight: "a" and "c" are over, "b" ends on EOS
        to_detok.send(
            make_batch(
                [("a", ids, ""), ("c", ids, ""), ("b", [EOS], "stop_token")],
                logprobs=[None] * n + [lp(-1.0)] * n + [None],
            )
        )

        got: dict[str, list] = {"a": [], "b": [], "c": []}
        where = {"a": 0, "b": 1, "c": 1}
        deadline = time.monotonic() + 10
        while not all(ds and ds[-1].finish_reason for ds in got.values()):
            assert time.monotonic() < deadline, got
            for i in (0, 1):
                msg = frontends[i].recv(timeout_ms=50)
                if msg is None:
                    continue
                assert isinstance(msg, TextDeltas), msg
                for d in msg.deltas:
                    assert where[d.request_id] == i
                    got[d.request_id].append(d)
        assert "".join(d.text for d in got["a"]) == "go "
        assert [d.finish_reason for d in got["a"]] == ["stop"]
        assert "".join(d.text for d in got["b"]) == "go STOP now"
        assert got["b"][-1].finish_reason == "stop" and got["b"][-1].num_output_tokens == n + 1
        assert [(d.finish_reason, d.error[:25]) for d in got["c"]] == [
            ("error", "detokenizer: ValueError: ")
        ]
        # one StreamEnded for the stop string, one for the failure, in that order
        assert core.recv(timeout_ms=5_000) == StreamEnded(["a"], "stop")
        assert core.recv(timeout_ms=5_000) == StreamEnded(["c"], "error")

        to_detok.send(Shutdown())
        thread.join(timeout=5)
        assert not thread.is_alive()
        assert core.recv(timeout_ms=200) is None  # the later tokens reported nothing more
        assert frontends[0].recv(timeout_ms=0) is None
        assert frontends[1].recv(timeout_ms=0) is None
    finally:
        for socket in (control, core, *frontends, to_detok):
            socket.close()
        ctx.term()
