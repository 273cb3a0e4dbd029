from __future__ import annotations

import threading

import zmq

from gapless.core.common.channel import Receiver, Sender
from gapless.core.common.config import EngineConfig, ModelInfo
from gapless.core.common.messages import (
    ControlMessage,
    CoreInput,
    DetokInput,
    FrontendInput,
    Ready,
    Shutdown,
    StopHit,
    TextDeltas,
)
from gapless.core.common.process import CONTROL, CORE_IN, DETOK_IN, frontend_socket
from gapless.detokenizer import process
from tests.detokenizer.util import EOS, make_batch, make_new

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
        ids = tokenizer.encode("go STOP now").ids
        to_detok.send(make_batch([("a", ids, ""), ("b", ids, "")]))
        to_detok.send(make_batch([("a", ids, ""), ("b", [EOS], "stop")]))

        got: dict[int, list] = {0: [], 1: []}
        for i in (0, 1):
            while not any(d.finish_reason for d in got[i]):
                msg = frontends[i].recv(timeout_ms=5_000)
                assert isinstance(msg, TextDeltas), msg
                got[i] += msg.deltas
        assert "".join(d.text for d in got[0]) == "go "
        assert got[0][-1].finish_reason == "stop"
        assert "".join(d.text for d in got[1]) == "go STOP now"
        assert core.recv(timeout_ms=5_000) == StopHit("a")

        to_detok.send(Shutdown())
        thread.join(timeout=5)
        assert not thread.is_alive()
        assert core.recv(timeout_ms=200) is None  # exactly one StopHit
        assert frontends[0].recv(timeout_ms=0) is None
    finally:
        for socket in (control, core, *frontends, to_detok):
            socket.close()
        ctx.term()
