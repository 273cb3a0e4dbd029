"""The frontend process under faults, with this test playing the core: a drain that runs out
of time, a core that goes silent, a supervisor that dies."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import zmq

from gapless.common.channel import Receiver, Sender
from gapless.common.config import CONFIG_ENV, encode_config
from gapless.common.messages import (
    Abort,
    AddRequest,
    ControlMessage,
    CoreInput,
    FrontendInput,
    Heartbeat,
    Ready,
    TextDelta,
    TextDeltas,
)
from gapless.common.process import CONTROL, CORE_IN, frontend_socket
from tests.server import free_port
from tests.timing import late_limit_s

ROOT = Path(__file__).resolve().parents[2]
WORKER = [sys.executable, "-m", "gapless.launch.worker", "frontend", "0"]
# a parent that starts the frontend, prints its pid, and waits: the test kills it
LAUNCHER = (
    "import subprocess, sys; p = subprocess.Popen(sys.argv[1:]); print(p.pid, flush=True); p.wait()"
)


class Front:
    """A frontend process started as the supervisor would, and the core's ends of its sockets."""

    def __init__(self, config, via_launcher: bool = False) -> None:
        self.config = config
        self.ctx = zmq.Context()
        self.control: Receiver[ControlMessage] = Receiver(
            self.ctx, config.ipc(CONTROL), ControlMessage
        )
        self.core_in: Receiver[CoreInput] = Receiver(self.ctx, config.ipc(CORE_IN), CoreInput)
        env = dict(os.environ, **{CONFIG_ENV: encode_config(config)})
        argv = [sys.executable, "-c", LAUNCHER, *WORKER] if via_launcher else WORKER
        self.proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
        self.pid = int(self.proc.stdout.readline()) if via_launcher else self.proc.pid
        self.to_front: Sender[FrontendInput] = Sender(self.ctx, config.ipc(frontend_socket(0)))
        ready = self.control.recv(timeout_ms=30_000)
        assert isinstance(ready, Ready), self.proc.poll()
        self.url = f"http://127.0.0.1:{config.port}"

    def stream(self, body: dict) -> tuple[threading.Thread, list[str], list[float]]:
        """A streaming request in a thread: its SSE lines, and when the stream ended."""
        lines: list[str] = []
        ended: list[float] = []

        def run() -> None:
            try:
                with httpx.stream("POST", self.url + "/v1/completions", json=body, timeout=30) as r:
                    lines.extend(r.iter_lines())
            except httpx.HTTPError as e:
                lines.append(f"transport error: {e}")
            ended.append(time.monotonic())

        thread = threading.Thread(target=run)
        thread.start()
        return thread, lines, ended

    def added(self) -> AddRequest:
        add = self.core_in.recv(timeout_ms=10_000)
        assert isinstance(add, AddRequest), add
        return add

    def close(self) -> str:
        for pid in {self.pid, self.proc.pid}:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        out = self.proc.communicate()[0] or ""
        for s in (self.control, self.core_in, self.to_front):
            s.close()
        self.ctx.term()
        return out


@pytest.fixture
def run_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("run")  # short: ipc paths are limited to ~107 bytes


@pytest.fixture
def front(request, make_config, run_dir: Path) -> Iterator[Front]:
    overrides = dict(getattr(request, "param", {}))
    via_launcher = overrides.pop("launcher", False)
    config = make_config(run_dir=str(run_dir), port=free_port(), **overrides)
    f = Front(config, via_launcher=via_launcher)
    yield f
    f.close()


def _events(lines: list[str]) -> list:
    return [
        line[6:] if line == "data: [DONE]" else json.loads(line[6:])
        for line in lines
        if line.startswith("data: ")
    ]


@pytest.mark.parametrize("front", [{"drain_timeout_s": 1.0}], indirect=True)
def test_drain_timeout_ends_streams_with_finish_reason_and_error(front: Front) -> None:
    thread, lines, ended = front.stream({"prompt": "hello", "max_tokens": 50, "stream": True})
    rid = front.added().request_id
    front.to_front.send(TextDeltas([TextDelta(rid, "Hi", [1], 1, 1)]))
    time.sleep(0.3)
    front.proc.send_signal(signal.SIGTERM)
    thread.join(10)
    assert front.proc.wait(10) == 0
    events = _events(lines)
    assert events[-1] == "[DONE]", lines
    assert events[-2]["error"]["code"] == "drain_timeout", events
    assert events[-3]["choices"][0]["finish_reason"] == "abort", events
    assert events[0]["choices"][0]["text"] == "Hi"
    abort = front.core_in.recv(timeout_ms=2000)
    assert isinstance(abort, Abort) and abort.request_ids == [rid]


def test_health_says_503_when_the_core_goes_silent(front: Front) -> None:
    for _ in range(4):  # a live core beats
        front.to_front.send(Heartbeat())
        time.sleep(0.5)
        assert httpx.get(front.url + "/health", timeout=2).status_code == 200
    silent_at = time.monotonic()
    while (r := httpx.get(front.url + "/health", timeout=2)).status_code == 200:
        assert time.monotonic() - silent_at < late_limit_s(3.0), (
            "still healthy long after the last beat (3 s bound)"
        )
        time.sleep(0.1)
    assert r.status_code == 503 and r.json()["status"] == "unresponsive", r.text
    assert "has not answered" in r.json()["reason"]
    front.to_front.send(Heartbeat())
    time.sleep(0.2)
    assert httpx.get(front.url + "/health", timeout=2).status_code == 200


def test_health_says_503_stalled_while_the_core_says_a_result_is_overdue(front: Front) -> None:
    front.to_front.send(Heartbeat(stalled_s=7.5, usual_s=0.012))
    time.sleep(0.2)
    r = httpx.get(front.url + "/health", timeout=2)
    assert r.status_code == 503 and r.json()["status"] == "stalled", r.text
    assert "7.5 s" in r.json()["reason"] and "0.012 s" in r.json()["reason"], r.text
    front.to_front.send(Heartbeat())  # results came again
    time.sleep(0.2)
    assert httpx.get(front.url + "/health", timeout=2).status_code == 200


@pytest.mark.parametrize("front", [{"launcher": True}], indirect=True)
def test_supervisor_death_ends_streams_and_the_frontend(front: Front, run_dir: Path) -> None:
    thread, lines, ended = front.stream({"prompt": "hello", "max_tokens": 50, "stream": True})
    rid = front.added().request_id
    front.to_front.send(TextDeltas([TextDelta(rid, "Hi", [1], 1, 1)]))
    time.sleep(0.3)
    os.kill(front.proc.pid, signal.SIGKILL)  # the launcher, the frontend's parent
    killed_at = time.monotonic()
    thread.join(5)
    assert ended and ended[0] - killed_at < late_limit_s(1.0), "the stream ended within 1 s"
    events = _events(lines)
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "engine_unavailable", lines
    while _alive(front.pid):
        assert time.monotonic() - killed_at < late_limit_s(1.0), "the frontend exited within 1 s"
        time.sleep(0.05)
    assert not run_dir.exists(), "the run directory is removed by the process left"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie of a dead launcher is reaped by init; look at its state
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False
