"""What waits for one request's stream handler: its deltas and markers, taken all at once, and
how deltas that waited are joined."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from gapless.common.messages import TextDelta

log = logging.getLogger("gapless.frontend")

IDLE = object()  # marker: idle_s passed without a delta


class Inbox:
    """A one-consumer queue for the engine client's fan-out, built to cost less per step than
    asyncio.Queue with a keep-alive timer armed per wait (bench/RESULTS.md, "The frontend's
    fan-out profile"): a put is a list append and, when the handler waits, one future's
    result; `take` hands over everything that waited, the deltas and the markers (end of
    stream, IDLE) apart, so a handler that fell behind does not look through its deltas for
    markers.

    With idle_s > 0, IDLE is put after each idle_s without a delta while nothing waits, by
    one timer per request that re-arms itself, not one timer per wait.

    `direct`, when the consumer sets one, may handle deltas in its place while it waits: the
    producer `hold`s deltas (queued, nobody woken) and then `flush`es each inbox it held
    into, once, when it has no more to add for now; a flush gives `direct` everything
    queued, if the consumer waits with no marker queued, so that nothing before those
    deltas is left unhandled. What `direct` declines wakes the consumer as a put would.
    """

    __slots__ = (
        "_deltas",
        "_marks",
        "_waiter",
        "_loop",
        "_idle_s",
        "_timer",
        "_last_delta",
        "_held",
        "direct",
        "name",
    )

    def __init__(
        self, loop: asyncio.AbstractEventLoop, idle_s: float = 0.0, name: str = ""
    ) -> None:
        self.name = name  # of the request, for logs
        self._deltas: list[Any] = []
        self._marks: list[object] = []
        self._waiter: asyncio.Future[None] | None = None
        self._loop = loop
        self._idle_s = idle_s
        self._last_delta = time.perf_counter()
        self._timer = loop.call_later(idle_s, self._tick) if idle_s > 0 else None
        self._held = False  # deltas were held since the last flush
        self.direct: Callable[[list[Any]], bool] | None = None

    def __len__(self) -> int:
        """Deltas waiting."""
        return len(self._deltas)

    def put_delta(self, item: Any, received: float) -> None:
        """A delta item that reached the frontend at perf_counter `received`."""
        self._deltas.append(item)
        self._last_delta = received
        self._wake()

    def hold(self, item: Any, received: float) -> bool:
        """`put_delta` without waking the consumer: True the first time since the last
        flush, when the caller must `flush` this inbox once it has added what it has."""
        self._deltas.append(item)
        self._last_delta = received
        if self._held:
            return False
        self._held = True
        return True

    def flush(self) -> None:
        """Held deltas go to `direct` if the consumer waits for them with no marker queued,
        else (or if `direct` declines) wake it. A `direct` that raises is logged and not
        asked again; the deltas stay queued for the consumer, so `direct` must not raise
        once it has handled them."""
        self._held = False
        if not self._deltas or self._waiter is None:
            return
        direct = self.direct
        if direct is not None and not self._marks:
            try:
                if direct(self._deltas):
                    self._deltas = []
                    return
            except Exception:
                log.exception("a stream's direct write failed; it goes through its handler now")
                self.direct = None
        self._wake()

    def waiting(self) -> list[Any]:
        """The delta items that wait, in order (the inbox's own list: read, do not change)."""
        return self._deltas

    def compact(self, fold: Callable[[list[Any]], list[Any]]) -> None:
        """What waits becomes fold(what waits), in the same place in the queue."""
        self._deltas = fold(self._deltas)

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


def joined(deltas: list[TextDelta]) -> TextDelta:
    """Deltas of one engine request, in order, as one (copied once, however many)."""
    first, last = deltas[0], deltas[-1]
    logprobs = None
    if any(d.logprobs is not None for d in deltas):
        logprobs = [lp for d in deltas if d.logprobs for lp in d.logprobs]
    prompt_logprobs = next(
        (d.prompt_logprobs for d in deltas if d.prompt_logprobs is not None), None
    )
    return TextDelta(
        first.request_id,
        "".join([d.text for d in deltas]),
        [t for d in deltas for t in d.token_ids],
        last.num_prompt_tokens,
        last.num_output_tokens,
        last.finish_reason,
        logprobs,
        last.error,
        last.code,
        num_cached_tokens=last.num_cached_tokens,
        prompt_logprobs=prompt_logprobs,
        embedding=last.embedding,
    )


def coalesced(items: list[tuple[TextDelta, float]]) -> list[tuple[TextDelta, float]]:
    """Queued (delta, received) items as one delta per engine request, in the order each
    request first appears, its own deltas joined in order; the received time is the first's,
    so the delivery latency counts from the oldest token.

    A consumer that keeps up takes one item at a time and this changes nothing; one that fell
    behind (a slow client, a busy event loop) sends one SSE event per choice for everything
    that waited instead of one per step, which is what lets it catch up."""
    groups: dict[str, list[tuple[TextDelta, float]]] = {}
    for item in items:
        group = groups.get(item[0].request_id)
        if group is None:
            groups[item[0].request_id] = [item]
        else:
            group.append(item)
    return [
        group[0] if len(group) == 1 else (joined([d for d, _ in group]), group[0][1])
        for group in groups.values()
    ]
