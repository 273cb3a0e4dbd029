"""The grammar pool between tenants: a free worker goes to the tenant with the fewest compiles
running, places in line are shared, and a tenant with nothing running takes a worker from
runaway compiles of tenants above their share. So however many tenants send runaway schemas
(with or without a keys file: tenants are names either way), a new tenant's small schema
compiles within PREEMPT_AFTER_S and a worker's start; checked with a 5 s margin."""

from __future__ import annotations

import asyncio
import time

import pytest
import tokenizers

from gapless.common.grammars import json_grammar
from gapless.frontend.grammar.pool import PREEMPT_AFTER_S, Busy, GrammarPool
from gapless.frontend.grammar.worker import WorkerInit
from tests.frontend.hostile_schemas import runaway_schema

pytestmark = pytest.mark.anyio
SIMPLE = json_grammar({"type": "string"}, strict=True)
PROMISE_S = 2.0  # what a new tenant's small schema waits at most, beside runaway tenants
MARGIN_S = 5.0


@pytest.fixture(scope="module")
def init(hf_tokenizer: tuple[tokenizers.Tokenizer, str]) -> WorkerInit:
    return WorkerInit(hf_tokenizer[0].to_str(), 49152, (2,), 256 * 2**20)


async def _hostile(pool: GrammarPool, tenant: str, stop: asyncio.Event, outcomes: list) -> None:
    """Runaway schemas from one tenant, four at a time, until stop."""

    async def one(i: int) -> None:
        while not stop.is_set():
            try:
                outcomes.append(await pool.compile(json_grammar(runaway_schema(i), strict=False),
                                                   tenant))  # fmt: skip
            except Busy as e:
                outcomes.append(e)
                await asyncio.sleep(0.05)

    await asyncio.gather(*(one(i) for i in range(4)))


@pytest.mark.parametrize("hostile", [2, 3])
async def test_a_new_tenant_compiles_beside_runaway_tenants(init, hostile: int) -> None:
    pool = GrammarPool(init, workers=2, timeout_s=5.0)
    stop, outcomes = asyncio.Event(), []
    pool.warm()
    tasks = [asyncio.ensure_future(_hostile(pool, f"h{k}", stop, outcomes)) for k in range(hostile)]
    took = []
    try:
        await asyncio.sleep(1.0)  # the runaways hold every worker, and the line
        for attempt in range(3):
            t0 = time.monotonic()
            why = await asyncio.wait_for(pool.compile(SIMPLE, f"new{attempt}"),
                                         PROMISE_S + MARGIN_S)  # fmt: skip
            took.append(time.monotonic() - t0)
            assert why == "", why
            await asyncio.sleep(PREEMPT_AFTER_S)
    finally:
        stop.set()
        pool.close()
        await asyncio.gather(*tasks, return_exceptions=True)
    print(f"a new tenant's compile beside {hostile} runaway tenants took", took)
    assert max(took) < PROMISE_S + MARGIN_S, took
    assert any(isinstance(o, Busy) for o in outcomes), "the runaways were stopped or refused"


async def test_a_free_worker_goes_to_the_tenant_with_fewest_running(init) -> None:
    """One worker: tenant a queues three compiles, b one after them; b's runs second."""
    pool = GrammarPool(init, workers=1, timeout_s=30.0)
    order: list[str] = []

    async def run(tenant: str) -> None:
        assert await pool.compile(SIMPLE, tenant) == ""
        order.append(tenant)

    try:
        pool.warm()
        tasks = [asyncio.ensure_future(run("a")) for _ in range(3)]
        await asyncio.sleep(0)
        tasks.append(asyncio.ensure_future(run("b")))
        await asyncio.gather(*tasks)
    finally:
        pool.close()
    assert order.index("b") <= 1, order


async def test_places_in_line_are_shared_and_a_new_tenant_always_finds_one(init) -> None:
    pool = GrammarPool(init, workers=1, timeout_s=30.0)
    places = pool.max_waiting
    runaway = json_grammar(runaway_schema(7), strict=False)
    try:
        running = asyncio.ensure_future(pool.compile(runaway, "a"))
        await asyncio.sleep(0.1)
        waiting = [asyncio.ensure_future(pool.compile(SIMPLE, "a")) for _ in range(places)]
        await asyncio.sleep(0.05)
        with pytest.raises(Busy):  # a holds every place: its next is refused at once
            await asyncio.wait_for(pool.compile(SIMPLE, "a"), 0.5)
        b = asyncio.ensure_future(pool.compile(SIMPLE, "b"))  # b finds one: a's newest
        await asyncio.sleep(0.05)
        assert waiting[-1].done() and isinstance(waiting[-1].exception(), Busy)
        assert not b.done()
        assert await asyncio.wait_for(b, PROMISE_S + MARGIN_S) == ""  # and a's runaway stops
        assert isinstance(running.exception(), Busy), running
    finally:
        pool.close()
        for task in [running, *waiting]:
            task.cancel()
        # each one ends (a compile that got its worker as it was cancelled, with Unavailable)
        # and is read here, not left to the collector to report as never retrieved
        await asyncio.wait_for(asyncio.gather(running, *waiting, return_exceptions=True), 10)
