from __future__ import annotations

import asyncio
import time

import pytest

from gapless.frontend.engine.inbox import IDLE, Inbox

pytestmark = pytest.mark.anyio


async def test_take_hands_over_everything_in_order() -> None:
    inbox = Inbox(asyncio.get_running_loop())
    waiting = asyncio.ensure_future(inbox.take())
    await asyncio.sleep(0)
    assert not waiting.done()
    inbox.put_delta("a", time.perf_counter())
    inbox.put("b")
    assert await waiting == (["a"], ["b"])
    inbox.put_delta("c", time.perf_counter())
    inbox.put_delta("d", time.perf_counter())
    assert len(inbox) == 2
    assert await inbox.take() == (["c", "d"], []) and len(inbox) == 0


async def test_a_cancelled_take_leaves_no_waiter() -> None:
    inbox = Inbox(asyncio.get_running_loop())
    waiting = asyncio.ensure_future(inbox.take())
    await asyncio.sleep(0)
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)
    inbox.put("x")  # no waiter to wake, no error
    assert await inbox.take() == ([], ["x"])


async def test_idle_only_after_idle_s_without_a_delta() -> None:
    inbox = Inbox(asyncio.get_running_loop(), idle_s=0.1)
    try:
        start = time.perf_counter()
        for _ in range(6):  # a delta every 50 ms for 300 ms: never idle
            await asyncio.sleep(0.05)
            inbox.put_delta("d", time.perf_counter())
            assert await inbox.take() == (["d"], [])
        assert time.perf_counter() - start >= 0.3
        quiet = time.perf_counter()
        assert await inbox.take() == ([], [IDLE])
        waited = time.perf_counter() - quiet
        assert 0.05 <= waited < 0.3, waited
        assert await inbox.take() == ([], [IDLE])  # and again after another idle_s
    finally:
        inbox.close()


async def test_flush_gives_direct_what_was_held_while_the_consumer_waits() -> None:
    inbox = Inbox(asyncio.get_running_loop(), idle_s=0.2)
    taken: list[list[str]] = []

    def direct(items: list[str]) -> bool:
        if "no" in items:
            return False
        taken.append(list(items))
        return True

    inbox.direct = direct
    try:
        assert inbox.hold("a", time.perf_counter()), "the first hold asks for a flush"
        assert not inbox.hold("b", time.perf_counter()), "one flush does for both"
        inbox.flush()
        assert taken == [] and len(inbox) == 2, "nobody waits: they stay for the consumer"
        assert await inbox.take() == (["a", "b"], [])
        waiting = asyncio.ensure_future(inbox.take())
        await asyncio.sleep(0)
        for item in "cd":
            inbox.hold(item, time.perf_counter())
        await asyncio.sleep(0)
        assert not waiting.done(), "held deltas wake nobody"
        inbox.flush()
        assert taken == [["c", "d"]] and len(inbox) == 0
        assert inbox.hold("e", time.perf_counter()), "flushed: the next hold asks again"
        inbox.hold("no", time.perf_counter())
        inbox.flush()
        assert await waiting == (["e", "no"], []), "declined: the consumer gets them, in order"
        waiting = asyncio.ensure_future(inbox.take())
        await asyncio.sleep(0)
        for item in "fgh":  # what direct takes counts as deltas for the keep-alive
            await asyncio.sleep(0.1)
            inbox.hold(item, time.perf_counter())
            inbox.flush()
        assert not waiting.done() and taken[-3:] == [["f"], ["g"], ["h"]]
        inbox.hold("i", time.perf_counter())
        inbox.put("end")
        assert await waiting == (["i"], ["end"]), "a marker wakes the consumer with what waits"
        inbox.flush()  # nobody waits now: nothing to do
        assert taken[-1] == ["h"]
    finally:
        inbox.close()
    assert inbox.direct is None


async def test_a_direct_that_raises_is_dropped_and_its_deltas_go_to_the_consumer(caplog):
    inbox = Inbox(asyncio.get_running_loop())

    def broken(items: list[str]) -> bool:
        raise RuntimeError("boom")

    inbox.direct = broken
    waiting = asyncio.ensure_future(inbox.take())
    await asyncio.sleep(0)
    inbox.hold("a", time.perf_counter())
    inbox.flush()
    assert inbox.direct is None and "direct write failed" in caplog.text
    assert await waiting == (["a"], [])
