"""`gapless serve` as a whole: READY, disconnects, a dying process, SIGTERM, nothing left over."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.server import Server
from tests.timing import late_limit_s

pytestmark = pytest.mark.slow

LONG = {
    "model": "tiny",
    "prompt": "count with me",
    "max_tokens": 1500,
    "ignore_eos": True,
    "temperature": 0,
    "stream": True,
}


def _serve(model_dir, *extra):
    return Server(
        "--model",
        str(model_dir),
        "--dtype",
        "float32",
        "--served-model-name",
        "tiny",
        "--max-model-len",
        "2048",
        *extra,
    )


def _stats(server, headers=None) -> dict:
    return httpx.get(server.url + "/v1/engine/stats", headers=headers, timeout=10).json()


def _shm_segments(run_dir: str) -> list[str]:
    """The shared-memory segments of one server's run (other servers may run beside it)."""
    run_id = os.path.basename(run_dir).removeprefix("gapless-")
    return [p.name for p in Path("/dev/shm").glob(f"gapless-{run_id}-*")]


def test_api_key_and_disconnect_frees_kv(tiny_model_dir):
    s = _serve(tiny_model_dir, "--api-key", "sekrit", "--admin-api-key", "root")
    try:
        auth = {"Authorization": "Bearer sekrit"}
        admin = {"Authorization": "Bearer root"}  # the engine routes need the admin key
        assert httpx.get(s.url + "/v1/engine/stats", headers=auth).status_code == 403
        assert httpx.get(s.url + "/health").status_code == 200
        r = httpx.post(s.url + "/v1/completions", json={"model": "tiny", "prompt": "x"})
        assert r.status_code == 401
        r = httpx.post(
            s.url + "/v1/completions",
            json={"model": "tiny", "prompt": "x"},
            headers={"Authorization": "Bearer wrong"},
        )
        assert r.status_code == 401
        idle = _stats(s, admin)
        assert idle["num_free_blocks"] == idle["num_total_blocks"]
        with httpx.stream(
            "POST", s.url + "/v1/completions", json=LONG, headers=auth, timeout=30
        ) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()
            for _ in range(5):
                next(lines)
            busy = _stats(s, admin)
            assert busy["num_free_blocks"] < idle["num_free_blocks"]
        # the client went away mid-stream: its blocks come back within a second
        deadline = time.monotonic() + 1.5
        while (
            time.monotonic() < deadline
            and _stats(s, admin)["num_free_blocks"] != idle["num_free_blocks"]
        ):
            time.sleep(0.05)
        after = _stats(s, admin)
        assert after["num_free_blocks"] == idle["num_free_blocks"] and after["num_running"] == 0
        # whatever full blocks the aborted request left stay cached, held by nobody
        assert idle["prefix_cache"]["num_cached_blocks"] == 0
        cache = after["prefix_cache"]
        assert cache["num_cached_free_blocks"] == cache["num_cached_blocks"]
        assert cache["queried_tokens"] > 0
    finally:
        assert s.stop() == 0, s.read_log()


def test_sigterm_drains_in_flight_requests_and_leaves_nothing(tiny_model_dir):
    s = _serve(tiny_model_dir)
    run_dir = s.run_dir()
    assert run_dir and os.path.isdir(run_dir) and (os.stat(run_dir).st_mode & 0o777) == 0o700
    body = dict(LONG, max_tokens=300)
    result: dict = {}

    def stream() -> None:
        with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=60) as resp:
            chunks = [line for line in resp.iter_lines() if line.startswith("data: {")]
            result["finish"] = json.loads(chunks[-1][6:])["choices"][0]["finish_reason"]
            result["n"] = len(chunks)

    t = threading.Thread(target=stream)
    t.start()
    time.sleep(0.5)
    s.proc.send_signal(signal.SIGTERM)
    t.join(60)
    assert s.proc.wait(60) == 0, s.read_log()
    assert result.get("finish") == "length", result
    assert not os.path.exists(run_dir), "the run directory is removed at exit"
    assert not _shm_segments(run_dir), "its shared memory is unlinked at exit"


def test_killed_runner_ends_streams_with_an_error_and_serve_exits(tiny_model_dir):
    s = _serve(tiny_model_dir)
    run_dir = s.run_dir()
    events: list = []
    done = threading.Event()

    def stream() -> None:
        try:
            with httpx.stream("POST", s.url + "/v1/completions", json=LONG, timeout=30) as resp:
                for line in resp.iter_lines():
                    events.append(line)
        except httpx.HTTPError as e:
            events.append(f"transport error: {e}")
        done.set()

    t = threading.Thread(target=stream)
    t.start()
    while len(events) < 3:
        time.sleep(0.01)
    runner = s.child_pids()["gapless-runner"]
    killed_at = time.monotonic()
    os.kill(runner, signal.SIGKILL)
    assert done.wait(late_limit_s(1.0)), "the stream ended within 1 s"
    assert time.monotonic() - killed_at < late_limit_s(1.0)
    assert any('"error"' in e for e in events), events[-3:]
    assert httpx.get(s.url + "/health", timeout=2).status_code == 503
    assert s.proc.wait(30) != 0, "serve exits non-zero when the engine dies"
    s.read_log()
    assert not os.path.exists(run_dir)


def test_timeline_endpoint_and_trace_file(tiny_model_dir, tmp_path):
    trace = tmp_path / "trace.json"
    s = _serve(tiny_model_dir, "--trace-file", str(trace))
    try:
        body = {"model": "tiny", "prompt": "timeline", "max_tokens": 20, "ignore_eos": True}
        assert httpx.post(s.url + "/v1/completions", json=body, timeout=30).status_code == 200
        tl = httpx.get(s.url + "/v1/engine/timeline?last=10", timeout=10).json()
        assert tl["device"] == "cpu" and tl["overlap"] is True
        assert 1 <= len(tl["steps"]) <= 10
        step = tl["steps"][-1]
        assert step["plan_sent"] <= step["plan_received"] <= step["launched"]
        assert step["device_start"] <= step["device_end"] <= step["published"]
        assert step["published"] <= step["result_applied"]
        assert tl["summary"]["busy_s"] > 0 and 0 <= tl["summary"]["idle_fraction"] <= 1
        assert httpx.get(s.url + "/v1/engine/timeline?last=x").status_code == 400
    finally:
        assert s.stop() == 0, s.read_log()
    events = json.loads(trace.read_text())
    steps = [e for e in events if e.get("ph") == "X" and e["name"].startswith("step")]
    assert len(steps) >= 20 and all(e["dur"] >= 0 for e in steps)
