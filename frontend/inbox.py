"""What waits for one request's stream handler: its deltas and markers, taken all at once."""

from __future__ import annotations

import asyncio
import time

IDLE = object()  # marker: idle_s passed without a delta


class Inbox:
    """A one-consumer queue for the engine client's fan-out, cheaper per step than
    asyncio.Queue (the fan-out + SSE profile at 256 streams had asyncio.Queue and the
    keep-alive timer armed per wait at ~20% of the step): a put is a list append and, when
    the handler waits, one future's result; `take` hands over everything that waited.

    With idle_s > 0, IDLE is put after each idle_s without a delta while nothing waits, by
    one timer per request that re-arms itself, not one timer per wait.
    """

    __slots__ = ("_items", "_waiter", "_loop", "_idle_s", "_timer", "_last_delta")

    def __init__(self, loop: asyncio.AbstractEventLoop, idle_s: float = 0.0) -> None:
        self._items: list[object] = []
        self._waiter: asyncio.Future[None] | None = None
        self._loop = loop
        self._idle_s = idle_s
        self._last_delta = time.perf_counter()
        self._timer = loop.call_later(idle_s, self._tick) if idle_s > 0 else None

    def __len__(self) -> int:
        return len(self._items)

    def put_delta(self, item: object, received: float) -> None:
        """A delta item that reached the frontend at perf_counter `received`."""
        self._last_delta = received
        self.put(item)

    def put(self, item: object) -> None:
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    async def take(self) -> list[object]:
        """Everything put since the last take, in order; waits while there is nothing."""
        if not self._items:
            waiter = self._waiter = self._loop.create_future()
            try:
                await waiter
            finally:
                self._waiter = None
        items, self._items = self._items, []
        return items

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _tick(self) -> None:
        quiet_s = time.perf_counter() - self._last_delta
        left_s = self._idle_s - quiet_s
        if left_s <= 1e-3:  # why the slack: timers fire up to a clock tick early
            if not self._items:
                self.put(IDLE)
            self._last_delta = time.perf_counter()
            left_s = self._idle_s
        self._timer = self._loop.call_later(left_s, self._tick)
