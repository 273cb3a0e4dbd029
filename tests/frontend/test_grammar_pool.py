"""The grammar pool: compiles in worker processes with a deadline and a memory cap (each
reached first on purpose, so no machine's speed picks the verdict), caps per tenant and in all,
workers killed at close and with their parent."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from concurrent.futures import Future

import pytest
import tokenizers

from gapless.common.grammars import json_grammar
from gapless.frontend.grammar.pool import Busy, GrammarPool, Unavailable, _Slot
from gapless.frontend.grammar.worker import WorkerInit
from tests.frontend.hostile_schemas import alive, runaway_schema, wait_gone
from tests.timing import late_limit_s

pytestmark = pytest.mark.anyio
SIMPLE = json_grammar({"type": "string"}, strict=True)
BAD = json_grammar({"type": "string", "pattern": "(("}, strict=True)


@pytest.fixture(scope="module")
def init(hf_tokenizer: tuple[tokenizers.Tokenizer, str]) -> WorkerInit:
    return WorkerInit(hf_tokenizer[0].to_str(), 49152, (2,), 256 * 2**20)


def runaway(i: int = 0) -> str:
    return json_grammar(runaway_schema(i), strict=False)


async def test_a_compile_past_its_deadline_ends_its_worker(init: WorkerInit) -> None:
    """The deadline reached first, on purpose: the worker is stopped (SIGSTOP), so the compile
    makes no progress and takes no memory whatever the machine's speed."""
    pool = GrammarPool(init, workers=1, timeout_s=1.0)
    try:
        assert await pool.compile(SIMPLE, "t") == ""
        assert await pool.compile(BAD, "t") != ""  # refused: a verdict, the worker lives on
        (pid,) = pool.worker_pids
        os.kill(pid, signal.SIGSTOP)
        t0 = time.monotonic()
        why = await pool.compile(SIMPLE, "t")
        took = time.monotonic() - t0
        assert why == "it did not compile within 1 s", why
        assert 1.0 <= took < late_limit_s(1.0), took
        assert wait_gone(pid, late_limit_s(0))
        assert await pool.compile(SIMPLE, "t") == ""  # a fresh worker
        assert pool.worker_pids and pool.worker_pids[0] != pid
    finally:
        pool.close()


async def test_a_compile_past_the_memory_cap_ends_its_worker(init: WorkerInit) -> None:
    """The memory cap reached first, on purpose: a small cap, a runaway schema that takes ever
    more memory, and a deadline minutes away."""
    small = WorkerInit(init.tokenizer_json, init.vocab_size, init.eos, 64 * 2**20)
    pool = GrammarPool(small, workers=1, timeout_s=300.0)
    try:
        assert await pool.compile(SIMPLE, "t") == ""
        (pid,) = pool.worker_pids
        why = await pool.compile(runaway(1), "t")
        assert why == "compiling it needs more than the 64 MiB a compile may use", why
        assert wait_gone(pid, late_limit_s(0))
        assert await pool.compile(SIMPLE, "t") == ""
    finally:
        pool.close()


class HeldCompiles:
    """The pool's workers replaced by compiles the test ends (`finish`): what the pool decides
    about waiting, with no compile's speed in it."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.started: list[tuple[str, Future[str]]] = []  # (grammar, its result) per compile

        def submit(slot: _Slot, grammar: str) -> Future[str]:
            future: Future[str] = Future()
            future.set_running_or_notify_cancel()
            self.started.append((grammar, future))
            return future

        monkeypatch.setattr(_Slot, "submit", submit)

    @property
    def grammars(self) -> list[str]:
        return [grammar for grammar, _ in self.started]

    def finish(self, grammar: str, verdict: str = "") -> None:
        (future,) = [f for g, f in self.started if g == grammar and not f.done()]
        future.set_result(verdict)


async def settle() -> None:
    """Lets every task started so far run up to its first real wait."""
    for _ in range(10):
        await asyncio.sleep(0)


async def test_one_tenant_runs_half_the_workers(monkeypatch) -> None:
    held = HeldCompiles(monkeypatch)
    pool = GrammarPool(WorkerInit("", 0, (), 0), workers=2, timeout_s=60.0)
    assert pool.per_tenant == 1
    try:
        first = asyncio.ensure_future(pool.compile("a1", "a"))
        second = asyncio.ensure_future(pool.compile("a2", "a"))  # waits: a runs one already
        other = asyncio.ensure_future(pool.compile("b1", "b"))  # finds the other worker
        await settle()
        assert held.grammars == ["a1", "b1"]
        held.finish("b1")
        assert await other == ""
        await settle()
        assert held.grammars == ["a1", "b1"] and not first.done() and not second.done()
        held.finish("a1", "no")
        assert await first == "no"
        await settle()
        assert held.grammars == ["a1", "b1", "a2"]  # a's next, once its first ended
        held.finish("a2")
        assert await second == ""
    finally:
        pool.close()


async def test_waiting_is_bounded_in_number_and_time(monkeypatch) -> None:
    held = HeldCompiles(monkeypatch)
    pool = GrammarPool(WorkerInit("", 0, (), 0), workers=1, timeout_s=1.5)
    try:
        running = asyncio.ensure_future(pool.compile("held", "a"))
        await settle()
        waiting = [asyncio.ensure_future(pool.compile(f"w{i}", f"t{i}")) for i in range(8)]
        await settle()
        with pytest.raises(Busy) as busy:  # the ninth finds the queue full, without waiting
            await pool.compile("late", "late")
        assert busy.value.retry_s == 2
        t0 = time.monotonic()
        results = await asyncio.gather(*waiting, return_exceptions=True)
        took = time.monotonic() - t0
        assert all(isinstance(r, Busy) for r in results), results  # waited past the bound
        assert 1.0 < took < late_limit_s(1.5), took
        assert held.grammars == ["held"]
        held.finish("held")
        assert await running == ""
        after = asyncio.ensure_future(pool.compile("after", "a"))  # the worker is free again
        await settle()
        held.finish("after")
        assert await after == ""
    finally:
        pool.close()


async def test_close_ends_running_and_waiting_compiles(init: WorkerInit) -> None:
    """Workers stopped (SIGSTOP) hold their compiles until close, on any machine."""
    pool = GrammarPool(init, workers=2, timeout_s=60.0)
    try:
        simple = [pool.compile(SIMPLE, tenant) for tenant in "ab"]  # one worker each
        assert await asyncio.gather(*simple) == ["", ""]
        pids = pool.worker_pids
        assert len(pids) == 2
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        tasks = [asyncio.ensure_future(pool.compile(SIMPLE, tenant)) for tenant in "aba"]
        await asyncio.sleep(0.2)
        assert not any(task.done() for task in tasks)
    finally:
        pool.close()
    for task in tasks:
        with pytest.raises(Unavailable):
            await asyncio.wait_for(task, late_limit_s(0))
    assert all(wait_gone(pid, late_limit_s(0)) for pid in pids)
    with pytest.raises(Unavailable):
        await pool.compile(SIMPLE, "c")


def test_workers_die_with_the_frontend(init: WorkerInit, tmp_path) -> None:
    """The process that owns the pool is SIGKILLed: its workers end too (no orphans)."""
    tok = tmp_path / "tokenizer.json"
    tok.write_text(init.tokenizer_json)
    script = textwrap.dedent(
        f"""
        import asyncio, pathlib, sys, time
        from gapless.frontend.grammar.pool import GrammarPool
        from gapless.frontend.grammar.worker import WorkerInit
        from gapless.common.grammars import json_grammar
        init = WorkerInit(pathlib.Path({str(tok)!r}).read_text(), 49152, (2,), 2**28)
        pool = GrammarPool(init, workers=2, timeout_s=30.0)
        async def main():
            await asyncio.gather(*(pool.compile(json_grammar({{"type": "string"}}, strict=True), t)
                                   for t in "ab"))
            print(*pool.worker_pids, flush=True)
            await pool.compile(sys.argv[1], "a")  # runs away until the owner is killed
        asyncio.run(main())
        """
    )
    owner = subprocess.Popen(
        [sys.executable, "-c", script, runaway(4)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert owner.stdout is not None
        pids = [int(p) for p in owner.stdout.readline().split()]
        assert len(pids) == 2 and all(alive(p) for p in pids)
        time.sleep(0.5)
        owner.send_signal(signal.SIGKILL)
        owner.wait(10)
        assert all(wait_gone(pid, 3.0) for pid in pids)
    finally:
        owner.kill()
        owner.wait()
