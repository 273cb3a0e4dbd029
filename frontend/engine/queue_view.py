"""What waits in the core for a seat, as one frontend sees it: admission control reads this.

"Queued" counts engine requests (each of a request's n choices) that have not started. A frontend
knows its own exactly: a request counts from its admission decision (so requests still being
tokenized count too), and each choice until its first delta comes or it ends. The other
frontends' part comes from the core's latest QueueState, which lags by up to
QUEUE_STATE_INTERVAL_S plus delivery (docs/architecture.md, "Admission").
"""

from __future__ import annotations

import time

from gapless.common.messages import QueueState

RATE_WINDOW_S = 10  # the start rate is over this many 1 s buckets, like the core's drain_per_s


class RateWindow:
    """Events per second over the last RATE_WINDOW_S seconds, in 1 s buckets: O(1) per event."""

    def __init__(self) -> None:
        self._second = [-1] * RATE_WINDOW_S  # int(time.monotonic()) each bucket counts
        self._count = [0] * RATE_WINDOW_S

    def add(self) -> None:
        now = int(time.monotonic())
        i = now % RATE_WINDOW_S
        if self._second[i] != now:
            self._second[i], self._count[i] = now, 0
        self._count[i] += 1

    def per_s(self) -> float:
        now = int(time.monotonic())
        fresh = (
            c for s, c in zip(self._second, self._count, strict=True) if now - s < RATE_WINDOW_S
        )
        return sum(fresh) / RATE_WINDOW_S


class Ticket:
    """One HTTP request's place in the count from its admission decision on: its n choices are
    queued until each starts or the request ends, its prompt tokens once they are known.
    `release()` takes out whatever is left; it is safe to call more than once."""

    __slots__ = ("_view", "tenant", "num_queued", "num_tokens")

    def __init__(self, view: QueueView, tenant: str, n: int) -> None:
        self._view, self.tenant = view, tenant
        self.num_queued = n  # choices not started
        self.num_tokens = 0  # prompt tokens of each choice
        view._add(tenant, n, 0)

    def set_prompt(self, num_tokens: int) -> None:
        self._view._add(self.tenant, 0, (num_tokens - self.num_tokens) * self.num_queued)
        self.num_tokens = num_tokens

    def leave(self, started: bool = False) -> None:
        """One choice is no longer queued: its first delta came (started: it carries tokens),
        or it ended here."""
        if self.num_queued:
            self.num_queued -= 1
            self._view._add(self.tenant, -1, -self.num_tokens)
            if started:
                self._view.starts.add()

    def release(self) -> None:
        if self.num_queued:
            self._view._add(self.tenant, -self.num_queued, -self.num_tokens * self.num_queued)
            self.num_queued = 0

    def __enter__(self) -> Ticket:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class QueueView:
    """Queued engine requests, their prompt tokens and per-tenant counts: this frontend's own,
    kept as tickets are taken and requests start, plus the other frontends' from the latest
    QueueState. O(1) per request and per delta."""

    def __init__(self, frontend_id: int) -> None:
        self.frontend_id = frontend_id
        self.unstarted: dict[str, Ticket] = {}  # engine id -> its request's ticket, until it starts
        self._num = 0  # this frontend's queued choices
        self._tokens = 0  # their prompt tokens
        self._tenants: dict[str, int] = {}  # tenant -> its queued choices here (none at 0)
        self._others = 0  # the other frontends' queued requests, from QueueState
        self._others_tokens = 0
        self._others_tenants: dict[str, int] = {}
        self.core_drain_per_s = 0.0  # seats the core freed per second (every frontend), last 10 s
        # replica -> (others, their tokens, per tenant, drain per s) from its latest QueueState
        self._replicas: dict[int, tuple[int, int, dict[str, int], float]] = {}
        self.starts = RateWindow()  # this frontend's requests that started

    def take(self, tenant: str, n: int) -> Ticket:
        return Ticket(self, tenant, n)

    def _add(self, tenant: str, n: int, tokens: int) -> None:
        self._num += n
        self._tokens += tokens
        if n:
            left = self._tenants.get(tenant, 0) + n
            if left:
                self._tenants[tenant] = left
            else:  # why: X-Tenant and `user` name tenants freely; the dict must not grow with them
                del self._tenants[tenant]

    def update(self, state: QueueState) -> None:
        """The other frontends' part, from a core's latest QueueState: summed over the engine
        replicas (--data-parallel-size), each one's latest."""
        me = self.frontend_id
        mine = me < len(state.waiting)
        num = sum(state.waiting) - (state.waiting[me] if mine else 0)
        tokens = sum(state.waiting_tokens) - (state.waiting_tokens[me] if mine else 0)
        others: dict[str, int] = {}
        for f, per_tenant in enumerate(state.tenant_waiting):
            if f != me:
                for tenant, n in per_tenant.items():
                    others[tenant] = others.get(tenant, 0) + n
        replicas = self._replicas
        replicas[state.replica] = (num, tokens, others, state.drain_per_s)
        self._others = sum(r[0] for r in replicas.values())
        self._others_tokens = sum(r[1] for r in replicas.values())
        total: dict[str, int] = {}
        for _, _, per_tenant, _ in replicas.values():
            for tenant, n in per_tenant.items():
                total[tenant] = total.get(tenant, 0) + n
        self._others_tenants = total
        self.core_drain_per_s = sum(r[3] for r in replicas.values())

    @property
    def num_queued(self) -> int:
        return self._num + self._others

    @property
    def num_queued_tokens(self) -> int:
        return self._tokens + self._others_tokens

    def num_tenant_queued(self, tenant: str) -> int:
        return self._tenants.get(tenant, 0) + self._others_tenants.get(tenant, 0)

    def drain_per_s(self) -> float:
        """Queued requests leaving per second: how fast the core freed seats, else (none reported
        yet, or none in its window) this frontend's own start rate."""
        return self.core_drain_per_s or self.starts.per_s()
