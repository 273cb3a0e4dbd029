"""`gapless serve` on the sim device under faults: stray frames on every internal socket, a
core that stops, a supervisor killed with streams open; and each request counted once."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from gapless.shm.frames import ANNOUNCE, MARK
from tests.server import Server
from tests.timing import late_limit_s

pytestmark = pytest.mark.slow

SOCKETS = ("core_in", "runner_in", "runner_out", "detok_in", "frontend_0", "control")
LONG = {"model": "sim", "prompt": "count", "max_tokens": 5000, "ignore_eos": True, "stream": True}


def _serve(default_gguf: Path) -> Server:
    return Server("--model", str(default_gguf), "--device", "sim", "--served-model-name", "sim")


def _samples(server: Server, name: str) -> dict[tuple, float]:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return {
        tuple(sorted(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name
    }


def _shm(run_dir: str) -> list[str]:
    run_id = os.path.basename(run_dir).removeprefix("gapless-")
    return [p.name for p in Path("/dev/shm").glob(f"gapless-{run_id}-*")]


def _stream(server: Server, events: list[str], ended: list[float]) -> threading.Thread:
    def run() -> None:
        try:
            with httpx.stream("POST", server.url + "/v1/completions", json=LONG, timeout=30) as r:
                for line in r.iter_lines():
                    events.append(line)
        except httpx.HTTPError as e:
            events.append(f"transport error: {e}")
        ended.append(time.monotonic())

    thread = threading.Thread(target=run)
    thread.start()
    while len(events) < 3 and thread.is_alive():
        time.sleep(0.01)
    return thread


def test_stray_frames_are_dropped_counted_and_serving_goes_on(default_gguf) -> None:
    s = _serve(default_gguf)
    try:
        run_dir = s.run_dir()
        assert run_dir
        ctx = zmq.Context()
        junk = [b"\xff\xfe", b"\x93\x01\x02\x03", bytes([MARK, ANNOUNCE]) + bytes(12) + b"../../x"]
        for name in SOCKETS:
            push = ctx.socket(zmq.PUSH)
            push.connect(f"ipc://{run_dir}/{name}")
            for frame in junk:
                push.send(frame)
            push.close(linger=1000)
        ctx.term()
        body = {"model": "sim", "prompt": "still here", "max_tokens": 8, "ignore_eos": True}
        r = httpx.post(s.url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
        deadline = time.monotonic() + 5
        while (bad := _samples(s, "gapless_bad_frames_total")) and time.monotonic() < deadline:
            if all(bad.get((("socket", n),), 0) == len(junk) for n in SOCKETS):
                break
            time.sleep(0.1)
        assert {dict(k)["socket"]: v for k, v in bad.items()} == dict.fromkeys(SOCKETS, 3.0)
        assert httpx.get(s.url + "/health", timeout=2).status_code == 200
    finally:
        assert s.stop() == 0, s.read_log()
    assert "Traceback" not in s.read_log(), s.read_log()


def test_each_request_is_counted_once_per_finish(default_gguf) -> None:
    s = _serve(default_gguf)
    try:
        base = {"model": "sim", "prompt": "hello", "ignore_eos": True}
        httpx.post(s.url + "/v1/completions", json=dict(base, max_tokens=5), timeout=30)
        r = httpx.post(
            s.url + "/v1/completions", json=dict(base, max_tokens=50, stop=["e"]), timeout=30
        )
        assert r.json()["choices"][0]["finish_reason"] == "stop"
        with httpx.stream("POST", s.url + "/v1/completions", json=LONG, timeout=30) as resp:
            lines = resp.iter_lines()
            for _ in range(5):
                next(lines)
        time.sleep(1.0)
        finished = {dict(k)["finish_reason"]: v for k, v in _samples(
            s, "gapless_requests_finished_total").items()}  # fmt: skip
        assert finished == {"stop": 1, "length": 1, "abort": 1, "error": 0}
    finally:
        assert s.stop() == 0, s.read_log()


def _health_turns(server: Server, status: int, within_s: float) -> httpx.Response:
    """Polls /health until it answers `status`; fails after within_s."""
    start = time.monotonic()
    while (r := httpx.get(server.url + "/health", timeout=2)).status_code != status:
        waited = time.monotonic() - start
        assert waited < within_s, f"/health not {status} after {waited:.1f} s: {r.text}"
        time.sleep(0.1)
    return r


def test_health_reflects_a_stopped_core_and_a_stopped_runner(default_gguf) -> None:
    """A stopped core is 503 unresponsive within its 3 s heartbeat bound; a runner stopped
    under load is 503 stalled within --stall-timeout (1 s here, sim steps being ms) and half a
    second's heartbeat; both 200 again after SIGCONT, and the streams complete. Margins: 5 s."""
    s = Server("--model", str(default_gguf), "--device", "sim", "--served-model-name", "sim",
               "--stall-timeout", "1")  # fmt: skip
    pids = s.child_pids()
    core, runner = pids["gapless-core"], pids["gapless-runner"]
    try:
        assert httpx.get(s.url + "/health", timeout=2).status_code == 200
        os.kill(core, signal.SIGSTOP)
        r = _health_turns(s, 503, 3.0 + 5.0)
        assert r.json()["status"] == "unresponsive", r.text
        os.kill(core, signal.SIGCONT)
        _health_turns(s, 200, 5.0)

        body = {**LONG, "max_tokens": 300}
        streams = [_collect(s, body) for _ in range(8)]
        os.kill(runner, signal.SIGSTOP)
        r = _health_turns(s, 503, 1.0 + 0.5 + 5.0)
        assert r.json()["status"] == "stalled", r.text
        assert "owed a step's result" in r.json()["reason"], r.text
        os.kill(runner, signal.SIGCONT)
        _health_turns(s, 200, 5.0)
        for thread, events in streams:
            thread.join(60)
            assert events[-1] == "data: [DONE]", events[-3:]
            assert not any('"error"' in e for e in events), [e for e in events if "error" in e]
            text = "".join(json.loads(e[6:])["choices"][0]["text"] for e in events[:-1] if e)
            assert text, events[:3]
        stalls = _samples(s, "gapless_engine_stalls_total")
        assert sum(stalls.values()) == 1, stalls
        assert any("stalled" in line for line in s.log), "the stall is logged"
    finally:
        os.kill(core, signal.SIGCONT)
        os.kill(runner, signal.SIGCONT)
        assert s.stop() == 0, s.read_log()


def _collect(server: Server, body: dict) -> tuple[threading.Thread, list[str]]:
    """Streams `body` in a thread until it has begun; the thread ends with the stream."""
    events: list[str] = []

    def run() -> None:
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
            events.extend(line for line in r.iter_lines() if line)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, events


def test_killed_supervisor_ends_streams_and_leaves_nothing(default_gguf) -> None:
    s = _serve(default_gguf)
    run_dir = s.run_dir()
    assert run_dir
    children = s.child_pids()
    events: list[str] = []
    ended: list[float] = []
    thread = _stream(s, events, ended)
    s.proc.kill()
    killed_at = time.monotonic()
    thread.join(late_limit_s(1.0))
    took = ended[0] - killed_at if ended else None
    # the stream ends within 1 s of the kill (the margin for a loaded machine); say how if not
    if took is None or took >= late_limit_s(1.0):
        s.proc.wait()
        pytest.fail(
            f"stream ended {took} s after the kill; last events {events[-4:]}; "
            f"children {children}; log tail:\n{s.read_log()[-4000:]}"
        )
    data = [json.loads(e[6:]) for e in events if e.startswith("data: {")]
    assert "error" in data[-1], events[-4:]
    assert [e for e in events if e][-1] == "data: [DONE]", events[-4:]
    for name, pid in children.items():
        while (
            os.path.exists(f"/proc/{pid}")
            and Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
        ):
            # why 5 s: a role notices its supervisor is gone on its next look, and the text
            # roles run at niceness 10, behind whatever else loads the machine
            assert time.monotonic() - killed_at < late_limit_s(5.0), (
                f"{name} still running long after the kill"
            )
            time.sleep(0.05)
    deadline = time.monotonic() + 2
    while (os.path.exists(run_dir) or _shm(run_dir)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(run_dir) and not _shm(run_dir)
    s.proc.wait()
