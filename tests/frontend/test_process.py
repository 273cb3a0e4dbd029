"""The frontend process as the supervisor starts it, with this test playing the core: READY,
SIGINT ignored, SIGTERM drains the in-flight stream and then exits."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from gapless.common.channel import Receiver, Sender
from gapless.common.config import CONFIG_ENV, encode_config
from gapless.common.messages import (
    AddRequest,
    ControlMessage,
    CoreInput,
    FrontendInput,
    Ready,
    TextDelta,
    TextDeltas,
)
from gapless.common.process import CONTROL, CORE_IN, frontend_socket
from gapless.frontend.server import bind_socket
from tests.server import free_port

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def run_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("run")  # short: ipc paths are limited to ~107 bytes


def test_sigterm_drains_then_exits(make_config, run_dir: Path) -> None:
    import zmq

    port = free_port()
    config = make_config(run_dir=str(run_dir), port=port, drain_timeout_s=10.0)
    ctx = zmq.Context()
    control: Receiver[ControlMessage] = Receiver(ctx, config.ipc(CONTROL), ControlMessage)
    core_in: Receiver[CoreInput] = Receiver(ctx, config.ipc(CORE_IN), CoreInput)
    env = dict(os.environ, **{CONFIG_ENV: encode_config(config)})
    proc = subprocess.Popen(
        [sys.executable, "-m", "gapless.launch.worker", "frontend", "0"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    to_front: Sender[FrontendInput] = Sender(ctx, config.ipc(frontend_socket(0)))
    try:
        ready = control.recv(timeout_ms=30_000)
        assert isinstance(ready, Ready), proc.poll()
        assert ready.role == "frontend0" and ready.info["port"] == port
        url = f"http://127.0.0.1:{port}"
        proc.send_signal(signal.SIGINT)  # the supervisor's signal, not the frontend's
        health = httpx.get(url + "/health", timeout=5)
        # why not 200: no core beats here, so once startup took past the heartbeat timeout
        # (a loaded machine) it says unresponsive; a drain would say draining
        assert health.json()["status"] in ("ok", "unresponsive"), health.text

        body: list[str] = []

        def stream() -> None:
            with httpx.stream(
                "POST",
                url + "/v1/completions",
                json={"prompt": "hello", "max_tokens": 2, "stream": True},
                timeout=20,
            ) as r:
                body.append(r.read().decode())

        client = threading.Thread(target=stream)
        client.start()
        add = core_in.recv(timeout_ms=10_000)
        assert isinstance(add, AddRequest)
        rid = add.request_id
        to_front.send(TextDeltas([TextDelta(rid, "Hi", [1], 1, 1)]))

        proc.send_signal(signal.SIGTERM)
        for _ in range(50):  # the listening socket closes while the stream goes on
            try:
                httpx.get(url + "/health", timeout=0.5)
            except httpx.TransportError:
                break
        else:
            pytest.fail("still accepting connections after SIGTERM")
        assert proc.poll() is None
        to_front.send(TextDeltas([TextDelta(rid, " there", [2], 1, 2, "length")]))
        client.join(10)
        assert proc.wait(10) == 0
        assert body and body[0].endswith("data: [DONE]\n\n") and " there" in body[0]
    finally:
        if proc.poll() is None:
            proc.kill()
        out = proc.communicate()[0]
        for s in (control, core_in, to_front):
            s.close()
        ctx.term()
    assert "Traceback" not in out, out


def test_frontends_share_the_port() -> None:
    first = bind_socket("127.0.0.1", 0)
    port = first.getsockname()[1]
    second = bind_socket("127.0.0.1", port)  # SO_REUSEPORT: a second frontend of the run
    assert second.getsockname()[1] == port
    first.close()
    second.close()
