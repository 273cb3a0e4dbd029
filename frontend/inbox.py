"""What waits for one request's stream handler: its deltas and markers, taken all at once."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("gapless.frontend")

IDLE = object()  # marker: idle_s passed without a delta


class Inbox:
    """A one-consumer queue for the engine client's fan-out, cheaper per step than
    asyncio.Queue (the fan-out + SSE profile at 256 streams had asyncio.Queue and the
    keep-alive timer armed per wait at ~20% of the step): a put is a list append and, when
    the handler waits, one future's result; `take` hands over everything that waited, the
    deltas and the markers (end of stream, IDLE) apart, so a handler that fell behind does
    not look through its deltas for markers.

    With idle_s > 0, IDLE is put after each idle_s without a delta while nothing waits, by
    one timer per request that re-arms itself, not one timer per wait.

    `direct`, when the consumer sets one, may take a delta in its place while the consumer
    waits with nothing queued (`offer`): the consumer's own handling, done by the producer,
    with no task woken. Whatever it declines is queued as usual.
    """

    __slots__ = (
        "_deltas",
        "_marks",
        "_waiter",
        "_loop",
        "_idle_s",
        "_timer",
        "_last_delta",
        "direct",
    )

    def __init__(self, loop: asyncio.AbstractEventLoop, idle_s: float = 0.0) -> None:
        self._deltas: list[Any] = []
        self._marks: list[object] = []
        self._waiter: asyncio.Future[None] | None = None
        self._loop = loop
        self._idle_s = idle_s
        self._last_delta = time.perf_counter()
        self._timer = loop.call_later(idle_s, self._tick) if idle_s > 0 else None
        self.direct: Callable[[Any, float], bool] | None = None

    def __len__(self) -> int:
        """Deltas waiting."""
        return len(self._deltas)

    def put_delta(self, item: Any, received: float) -> None:
        """A delta item that reached the frontend at perf_counter `received`."""
        self._deltas.append(item)
        self._last_delta = received
        self._wake()

    def offer(self, item: Any, received: float) -> bool:
        """Hands a delta item to `direct` if the consumer waits with nothing queued, so that
        everything before it has been handled; True if `direct` took it. A `direct` that
        raises is logged and not asked again: the delta, and the later ones, are queued."""
        direct = self.direct
        if direct is None or self._waiter is None or self._deltas or self._marks:
            return False
        try:
            taken = direct(item, received)
        except Exception:
            log.exception("a stream's direct write failed; it goes through its handler now")
            self.direct = None
            return False
        if taken:
            self._last_delta = received
        return taken

    def put(self, marker: object) -> None:
        self._marks.append(marker)
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    async def take(self) -> tuple[list[Any], list[object]]:
        """(deltas, markers) put since the last take, each in order; waits while there are
        none."""
        if not self._deltas and not self._marks:
            waiter = self._waiter = self._loop.create_future()
            try:
                await waiter
            finally:
                self._waiter = None
        deltas, marks = self._deltas, self._marks
        self._deltas = []
        if marks:
            self._marks = []
        return deltas, marks

    def close(self) -> None:
        self.direct = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _tick(self) -> None:
        quiet_s = time.perf_counter() - self._last_delta
        left_s = self._idle_s - quiet_s
        if left_s <= 1e-3:  # why the slack: timers fire up to a clock tick early
            if not self._deltas and not self._marks:
                self.put(IDLE)
            self._last_delta = time.perf_counter()
            left_s = self._idle_s
        self._timer = self._loop.call_later(left_s, self._tick)
