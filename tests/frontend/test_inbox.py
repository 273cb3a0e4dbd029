from __future__ import annotations

import asyncio
import time

import pytest

from gapless.frontend.inbox import IDLE, Inbox

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


async def test_offer_goes_to_direct_only_while_the_consumer_waits_with_nothing_queued() -> None:
    inbox = Inbox(asyncio.get_running_loop(), idle_s=0.2)
    taken: list[str] = []
    inbox.direct = lambda item, received: item != "no" and not taken.append(item)
    try:
        assert not inbox.offer("a", time.perf_counter()), "nobody waits yet"
        inbox.put_delta("a", time.perf_counter())
        waiting = asyncio.ensure_future(inbox.take())
        await asyncio.sleep(0)
        assert waiting.done() and waiting.result() == (["a"], [])
        waiting = asyncio.ensure_future(inbox.take())
        await asyncio.sleep(0)
        assert inbox.offer("b", time.perf_counter()) and taken == ["b"]
        assert not waiting.done(), "a taken delta wakes nobody"
        assert not inbox.offer("no", time.perf_counter()), "declined"
        inbox.put_delta("no", time.perf_counter())
        assert not inbox.offer("c", time.perf_counter()), "behind a queued delta"
        inbox.put_delta("c", time.perf_counter())
        assert await waiting == (["no", "c"], []) and taken == ["b"]
        waiting = asyncio.ensure_future(inbox.take())
        await asyncio.sleep(0)
        for item in "def":  # taken deltas count as deltas for the keep-alive
            await asyncio.sleep(0.1)
            assert inbox.offer(item, time.perf_counter())
        assert not waiting.done() and taken == ["b", "d", "e", "f"]
        inbox.put("end")
        assert await waiting == ([], ["end"])
    finally:
        inbox.close()
    assert inbox.direct is None


async def test_a_direct_that_raises_is_dropped_and_its_delta_queued(caplog) -> None:
    inbox = Inbox(asyncio.get_running_loop())

    def broken(item: object, received: float) -> bool:
        raise RuntimeError("boom")

    inbox.direct = broken
    waiting = asyncio.ensure_future(inbox.take())
    await asyncio.sleep(0)
    assert not inbox.offer("a", time.perf_counter())
    assert inbox.direct is None and "direct write failed" in caplog.text
    inbox.put_delta("a", time.perf_counter())
    assert await waiting == (["a"], [])
