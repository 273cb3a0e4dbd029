"""The grammar pool: compiles in worker processes with a deadline and a memory cap, caps per
tenant and in all, workers killed at close and with their parent."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import tokenizers

from gapless.common.grammars import json_grammar
from gapless.frontend.grammar_pool import Busy, GrammarPool, Unavailable
from gapless.frontend.grammar_worker import WorkerInit
from tests.frontend.hostile_schemas import alive, runaway_schema, wait_gone

pytestmark = pytest.mark.anyio
SIMPLE = json_grammar({"type": "string"}, strict=True)
BAD = json_grammar({"type": "string", "pattern": "(("}, strict=True)


@pytest.fixture(scope="module")
def init(hf_tokenizer: tuple[tokenizers.Tokenizer, str]) -> WorkerInit:
    return WorkerInit(hf_tokenizer[0].to_str(), 49152, (2,), 256 * 2**20)


def runaway(i: int = 0) -> str:
    return json_grammar(runaway_schema(i), strict=False)


async def test_runaway_compile_is_stopped_and_its_worker_replaced(init: WorkerInit) -> None:
    pool = GrammarPool(init, workers=1, timeout_s=1.0)
    try:
        assert await pool.compile(SIMPLE, "t") == ""
        assert await pool.compile(BAD, "t") != ""  # refused: a verdict, the worker lives on
        (pid,) = pool.worker_pids
        t0 = time.monotonic()
        why = await pool.compile(runaway(), "t")
        took = time.monotonic() - t0
        assert why == "it did not compile within 1 s", why
        assert took < 2.5, took
        assert wait_gone(pid, 1.0)
        assert await pool.compile(SIMPLE, "t") == ""  # a fresh worker
        assert pool.worker_pids and pool.worker_pids[0] != pid
    finally:
        pool.close()


async def test_a_compile_past_the_memory_cap_ends_its_worker(init: WorkerInit) -> None:
    small = WorkerInit(init.tokenizer_json, init.vocab_size, init.eos, 64 * 2**20)
    pool = GrammarPool(small, workers=1, timeout_s=60.0)
    try:
        assert await pool.compile(SIMPLE, "t") == ""
        (pid,) = pool.worker_pids
        t0 = time.monotonic()
        why = await pool.compile(runaway(1), "t")
        assert why == "compiling it needs more than the 64 MiB a compile may use", why
        assert time.monotonic() - t0 < 30
        assert wait_gone(pid, 1.0)
        assert await pool.compile(SIMPLE, "t") == ""
    finally:
        pool.close()


async def test_one_tenant_runs_half_the_workers_and_close_ends_everything(init) -> None:
    pool = GrammarPool(init, workers=2, timeout_s=20.0)
    assert pool.per_tenant == 1
    try:
        pool.warm()
        assert await pool.compile(SIMPLE, "b") == ""
        first = asyncio.ensure_future(pool.compile(runaway(2), "a"))
        await asyncio.sleep(0.3)
        second = asyncio.ensure_future(pool.compile(SIMPLE, "a"))  # waits: a runs one already
        t0 = time.monotonic()
        assert await pool.compile(json_grammar({"type": "integer"}, strict=True), "b") == ""
        assert time.monotonic() - t0 < 2.0  # another tenant finds the other worker
        await asyncio.sleep(0.2)
        assert not first.done() and not second.done()
        pids = pool.worker_pids
        assert len(pids) == 2
    finally:
        pool.close()
    for task in (first, second):
        with pytest.raises(Unavailable):
            await asyncio.wait_for(task, 5)
    assert all(wait_gone(pid, 2.0) for pid in pids)
    with pytest.raises(Unavailable):
        await pool.compile(SIMPLE, "c")


async def test_waiting_is_bounded_in_number_and_time(init: WorkerInit) -> None:
    """A tenant's places in line are bounded (its next compile is Busy at once) and a place is
    held at most timeout_s (then Busy). The worker is held with no compile in it, so neither a
    compile's deadline nor its memory cap decides anything here."""
    pool = GrammarPool(init, workers=1, timeout_s=1.5)
    try:
        slot = await pool._acquire("a")  # tenant a holds the worker, compiling nothing
        waiting = [asyncio.ensure_future(pool.compile(SIMPLE, "a")) for _ in range(8)]
        await asyncio.sleep(0.05)
        with pytest.raises(Busy) as busy:  # past a's places, at once
            await asyncio.wait_for(pool.compile(SIMPLE, "a"), 0.5)
        assert busy.value.retry_s == 2
        t0 = time.monotonic()
        results = await asyncio.gather(*waiting, return_exceptions=True)
        assert all(isinstance(r, Busy) for r in results), results  # waited past the bound
        assert time.monotonic() - t0 < 1.5 + 5
        pool._release(slot, "a")
        assert await pool.compile(SIMPLE, "a") == ""
    finally:
        pool.close()


def test_workers_die_with_the_frontend(init: WorkerInit, tmp_path) -> None:
    """The process that owns the pool is SIGKILLed: its workers end too (no orphans)."""
    tok = tmp_path / "tokenizer.json"
    tok.write_text(init.tokenizer_json)
    script = textwrap.dedent(
        f"""
        import asyncio, pathlib, sys, time
        from gapless.frontend.grammar_pool import GrammarPool
        from gapless.frontend.grammar_worker import WorkerInit
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
