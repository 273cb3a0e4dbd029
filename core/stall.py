"""Whether the device makes progress: the oldest step in flight against the steps before it.

A runner (or one tensor-parallel rank) that is stopped, hung in a kernel or starved of CPU keeps
its sockets open, so the core's own loop goes on turning and its heartbeat alone says nothing.
What does say something is a step whose result is overdue: the runner has owed it for longer
than `max(floor_s, FACTOR x the slowest of the last KEEP results)`. While that holds, every
heartbeat carries how long, and the frontends answer /health with 503 "stalled".
"""

from __future__ import annotations

from collections import deque

FACTOR = 8.0  # a step this many times slower than the slowest recent one is no longer "slow"
KEEP = 64  # recent results whose time sets the usual


class StallWatch:
    """Times the runner's results. `owed(now)` when a step is sent with none in flight,
    `result(now, more)` when a result is applied (`more`: steps are still in flight)."""

    def __init__(self, floor_s: float) -> None:
        self.floor_s = floor_s
        self._since: float | None = None  # since when the runner owes the oldest step's result
        self._recent: deque[float] = deque(maxlen=KEEP)  # seconds each result took to come
        self.stalls = 0  # how many times a step went past the bound
        self._stalled = False

    def owed(self, now: float) -> None:
        if self._since is None:
            self._since = now

    def result(self, now: float, more: bool) -> float:
        """Records one result; returns how long the stall it ends lasted (0.0 if none)."""
        ended = 0.0
        if self._since is not None:
            waited = now - self._since
            if self._stalled:
                ended = waited
            self._recent.append(waited)
        self._since = now if more else None
        self._stalled = False
        return ended

    @property
    def bound_s(self) -> float:
        """How long a result may be owed before the runner counts as stalled."""
        return max(self.floor_s, FACTOR * max(self._recent, default=0.0))

    @property
    def usual_s(self) -> float:
        """The slowest of the recent results (0.0 before the first)."""
        return max(self._recent, default=0.0)

    def overdue_s(self, now: float) -> float:
        """How long the oldest step's result has been owed, if past the bound; else 0.0. The
        first call that finds it past the bound counts a stall."""
        if self._since is None:
            return 0.0
        waited = now - self._since
        if waited <= self.bound_s:
            return 0.0
        if not self._stalled:
            self._stalled = True
            self.stalls += 1
        return waited
