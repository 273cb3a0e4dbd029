"""`gapless serve` (sim) against runaway schemas: chat requests go on unharmed beside ten of
them, the frontend comes back to rest, and SIGTERM ends the server, and its compile workers,
while one runs away."""

from __future__ import annotations

import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil
import pytest

from gapless.frontend.grammar.pool import PREEMPT_AFTER_S
from tests.frontend.hostile_schemas import runaway_schema, wait_gone
from tests.server import Server
from tests.timing import late_limit_s

pytestmark = pytest.mark.slow
DRAIN_S = 2.0


def _fmt(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}


def _chat(url: str, i: int) -> tuple[int, float]:
    body = {
        "model": "sim",
        "messages": [{"role": "user", "content": f"hello number {i}"}],
        "max_tokens": 4,
    }
    if i % 2:
        body["response_format"] = {"type": "json_object"}
    t0 = time.monotonic()
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=30)
    return r.status_code, time.monotonic() - t0


def _hostile(url: str, i: int) -> int:
    body = {"model": "sim", "messages": [{"role": "user", "content": "hi"}]}
    body["response_format"] = _fmt(runaway_schema(1000 + i))
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=60).status_code


def _frontend(server: Server) -> psutil.Process:
    (proc,) = [
        p for p in psutil.Process(server.proc.pid).children() if "frontend" in " ".join(p.cmdline())
    ]
    return proc


def _workers(frontend: psutil.Process) -> list[psutil.Process]:
    return [
        p for p in frontend.children() if "gapless.frontend.grammar.worker" in " ".join(p.cmdline())
    ]


def _at_rest(procs: list[psutil.Process]) -> tuple[float, float]:
    """(CPU share over one second, RSS in MB) of these processes together."""
    cpu0 = sum(sum(p.cpu_times()[:2]) for p in procs)
    time.sleep(1.0)
    cpu1 = sum(sum(p.cpu_times()[:2]) for p in procs)
    return cpu1 - cpu0, sum(p.memory_info().rss for p in procs) / 2**20


def test_runaway_schemas_against_a_server(default_gguf: Path) -> None:
    s = Server(
        "--model",
        str(default_gguf),
        "--device",
        "sim",
        "--served-model-name",
        "sim",
        "--drain-timeout",
        str(DRAIN_S),
    )
    try:
        frontend = _frontend(s)
        deadline = time.monotonic() + 30
        while len(_workers(frontend)) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)  # warm() starts both at serve
        base = [_chat(s.url, i) for i in range(6)]
        assert [c for c, _ in base] == [200] * 6
        _, rss0 = _at_rest([frontend, *_workers(frontend)])

        with ThreadPoolExecutor(12) as pool:
            attack = [pool.submit(_hostile, s.url, i) for i in range(10)]
            time.sleep(0.3)
            chats = [_chat(s.url, i) for i in range(20)]
            codes = [f.result() for f in attack]
        assert all(code in (400, 429) for code in codes), codes
        assert [c for c, _ in chats] == [200] * 20
        # a chat never waits on a runaway compile: each is answered well before the pool
        # preempts one (how fast the machine is lies in `gapless bench`, not here)
        slowest = max(t for _, t in chats)
        assert slowest < late_limit_s(PREEMPT_AFTER_S), ([t for _, t in base], slowest)

        # back at rest: the last compile's worker replaced, nothing spinning
        deadline = time.monotonic() + 30
        while True:
            procs = [frontend, *_workers(frontend)]
            cpu, rss1 = _at_rest(procs)
            if (len(procs) == 3 and cpu < 0.3) or time.monotonic() > deadline:
                break
        assert len(procs) == 3, procs
        assert cpu < 0.3, cpu
        assert rss1 - rss0 < 300, (rss0, rss1)

        # SIGTERM while a compile runs away: the server ends within its drain, workers too
        workers = [p.pid for p in _workers(frontend)]
        last = threading.Thread(target=lambda: _swallow(_hostile, s.url, 99), daemon=True)
        last.start()
        time.sleep(0.5)
        t0 = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        assert s.proc.wait(30) == 0, s.read_log()
        assert time.monotonic() - t0 < late_limit_s(DRAIN_S)
        assert all(wait_gone(pid, 2.0) for pid in workers)
    finally:
        s.stop()


def _swallow(fn, *args) -> None:
    try:
        fn(*args)
    except httpx.HTTPError:
        pass  # the server may close the connection as it exits
