"""Scheduling policies: which waiting request runs next and which running request is preempted.

The scheduler is the mechanism (token budget, chunked prefill, KV blocks, seats, the pipeline)
and asks a policy only these questions. Three policies:

- `fcfs`: arrival order; the newest running request is preempted first.
- `priority`: lower `priority` first, arrival order within a class; a waiting request of a
  lower number that cannot get a seat or KV blocks preempts the running request with the
  highest number (newest first).
- `fair` (the default): `priority` across classes; within a class, the backlogged tenant with
  the least weighted service goes first (virtual token counters, VTC): a tenant is charged its
  prompt tokens when they are computed (a recompute after preemption is free) and
  `output_weight` per sampled token, each divided by its weight. A tenant that comes back from
  idle (nothing waiting, nothing running) is lifted to the least counter among the backlogged
  ones, so it banks no credit.
  A tenant's requests keep their arrival order. The choice also counts what a tenant's running
  requests may still sample (their max_tokens left, weighted like outputs; released when they
  end): without it a tenant arriving while others hold every seat takes every seat that frees
  until its delivered service catches up, overshoots, then starves in turn.

Every policy ages: a request that has waited `aging_s` seconds is admitted before any newer
one, whatever its class or tenant. That bounds how long the lowest class can starve.

A waiting request's place is its arrival number (`Request.seq`), so a preempted request goes
back to its place in line, not to the back.
"""

from __future__ import annotations

import bisect
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator

import numpy as np

from gapless.core.request import Request

_BY_SEQ = lambda r: r.seq  # noqa: E731


def _resized(a: np.ndarray, n: int) -> np.ndarray:
    return np.concatenate([a, np.zeros(n - len(a), a.dtype)])


def _take(queue: list[Request], req: Request) -> None:
    """Remove req from a queue sorted by seq."""
    i = bisect.bisect_left(queue, req.seq, key=_BY_SEQ)
    assert i < len(queue) and queue[i] is req, f"{req.request_id} is not waiting here"
    del queue[i]


class Policy:
    """FCFS, and the queue every policy keeps: waiting requests in arrival order."""

    name = "fcfs"
    ranks_by_priority = False

    def __init__(self, aging_s: float = 30.0, clock: Callable[[], float] = time.monotonic):
        self.aging_s = aging_s
        self.clock = clock
        self._queue: list[Request] = []  # every waiting request, by seq
        self._by_wait: OrderedDict[Request, None] = OrderedDict()  # by queued_at, oldest first
        self.num_aged = 0  # requests admitted after waiting aging_s or longer
        # [T] tokens served per tenant: prompt tokens computed (once each), outputs sampled
        self.prompt_tokens = np.zeros(0, np.int64)
        self.output_tokens = np.zeros(0, np.int64)
        self.tenants: list[str] = []  # tenant of each index
        self._ids: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)

    def add(self, req: Request) -> None:
        """A request joins, new or back from preemption: it keeps its place in line, and its
        wait for aging starts now (a victim must not come back aged and retake its seat)."""
        bisect.insort(self._queue, req, key=_BY_SEQ)
        req.queued_at = self.clock()
        self._by_wait[req] = None

    def remove(self, req: Request) -> None:
        """Admitted, or ended while waiting."""
        _take(self._queue, req)
        del self._by_wait[req]

    def peek(self) -> Request | None:
        """The request to admit next, or None."""
        return self._queue[0] if self._queue else None

    def _aged(self) -> Request | None:
        """The request that has waited longest since it joined, if that is aging_s or more."""
        oldest = next(iter(self._by_wait), None)
        if oldest is not None and self.clock() - oldest.queued_at >= self.aging_s:
            return oldest
        return None

    def victim(self, running: list[Request]) -> Request:
        """Whom to preempt when KV blocks run out: the newest admitted."""
        return running[-1]

    def outranks(self, waiting: Request, running: Request) -> bool:
        """May `waiting` preempt `running` to get a seat or KV blocks?"""
        return False

    # service accounting, per tenant (for metrics; `fair` also schedules by it)
    def tenant_id(self, tenant: str) -> int:
        t = self._ids.get(tenant)
        if t is None:
            t = self._ids[tenant] = len(self.tenants)
            self.tenants.append(tenant)
            if t == len(self.prompt_tokens):  # arrays grow by doubling: O(1) per tenant
                self._grow(max(8, 2 * t))
            self._new_tenant(t, tenant)
        return t

    def _grow(self, n: int) -> None:
        """Every per-tenant array to n entries (the ones past len(tenants) stay zero)."""
        self.prompt_tokens = _resized(self.prompt_tokens, n)
        self.output_tokens = _resized(self.output_tokens, n)

    def _new_tenant(self, t: int, tenant: str) -> None:
        pass

    def charge_prompt(self, req: Request, num_tokens: int) -> None:
        self.prompt_tokens[req.tenant_id] += num_tokens

    def on_admit(self, req: Request, max_outputs: int) -> None:
        """req takes a seat and may sample up to max_outputs more tokens there."""
        if self.clock() - req.queued_at >= self.aging_s:
            self.num_aged += 1

    def on_leave(self, req: Request, unsampled: int) -> None:
        """req leaves its seat; `unsampled` of the tokens allowed at admission will not be
        sampled there (or charged) after all."""

    def charge_outputs(self, tenant_ids: np.ndarray) -> None:
        """One sampled token for each entry of tenant_ids [R]."""
        n = len(self.output_tokens)
        self.charge_output_counts(np.bincount(tenant_ids, minlength=n)[:n])

    def charge_output_counts(self, tokens: np.ndarray) -> None:
        """tokens[t] sampled tokens for tenant t: [T], as long as the per-tenant arrays."""
        self.output_tokens += tokens

    def charge_rejected(self, tokens: np.ndarray) -> None:
        """tokens[t] drafts the device verified for tenant t and rejected: [T]. Charged as
        output, they are work no request's max_tokens foresaw."""
        self.output_tokens += tokens


class PriorityPolicy(Policy):
    name = "priority"
    ranks_by_priority = True

    def __init__(self, aging_s: float = 30.0, clock: Callable[[], float] = time.monotonic):
        super().__init__(aging_s, clock)
        self._classes: dict[int, list[Request]] = {}  # priority -> its waiting requests, by seq

    def add(self, req: Request) -> None:
        super().add(req)
        bisect.insort(self._classes.setdefault(req.priority, []), req, key=_BY_SEQ)

    def remove(self, req: Request) -> None:
        super().remove(req)
        queue = self._classes[req.priority]
        _take(queue, req)
        if not queue:
            del self._classes[req.priority]

    def peek(self) -> Request | None:
        if not self._queue:
            return None
        return self._aged() or self._pick(min(self._classes))

    def _pick(self, priority: int) -> Request:
        """The next request of one class."""
        return self._classes[priority][0]

    def victim(self, running: list[Request]) -> Request:
        return max(running, key=lambda r: (r.priority, r.seq))

    def outranks(self, waiting: Request, running: Request) -> bool:
        return waiting.priority < running.priority


class FairPolicy(PriorityPolicy):
    name = "fair"

    def __init__(
        self,
        weights: dict[str, float] | None = None,
        output_weight: float = 2.0,
        aging_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(aging_s, clock)
        self.output_weight = output_weight
        self._weights = dict(weights or {})  # tenant -> weight; unknown tenants weigh 1
        self.counters = np.zeros(0)  # [T] weighted service: tokens / weight
        self._inv_weight = np.zeros(0)  # [T] 1 / weight
        self._backlog = np.zeros(0, np.int64)  # [T] waiting requests per tenant
        self._running = np.zeros(0, np.int64)  # [T] requests holding a seat per tenant
        # [T] weighted output that running requests may still sample (their max_tokens left)
        self.committed = np.zeros(0)
        # priority -> tenant id -> that tenant's waiting requests of the class, by seq
        self._tenant_queues: dict[int, dict[int, list[Request]]] = {}

    def _grow(self, n: int) -> None:
        super()._grow(n)
        self.counters = _resized(self.counters, n)
        self._inv_weight = _resized(self._inv_weight, n)
        self._backlog = _resized(self._backlog, n)
        self._running = _resized(self._running, n)
        self.committed = _resized(self.committed, n)

    def _new_tenant(self, t: int, tenant: str) -> None:
        self._inv_weight[t] = 1.0 / self._weights.get(tenant, 1.0)

    def add(self, req: Request) -> None:
        t = req.tenant_id
        # back from idle (nothing waiting, nothing running): no banked credit. A tenant whose
        # requests reach the core more slowly than seats free is not idle between them, nor
        # one whose preempted request comes back.
        if self._backlog[t] == 0 and self._running[t] == 0 and not req.started:
            others = self._backlog > 0
            if others.any():
                self.counters[t] = max(self.counters[t], self.counters[others].min())
        self._backlog[t] += 1
        super().add(req)
        queues = self._tenant_queues.setdefault(req.priority, {})
        bisect.insort(queues.setdefault(t, []), req, key=_BY_SEQ)

    def remove(self, req: Request) -> None:
        super().remove(req)
        t = req.tenant_id
        self._backlog[t] -= 1
        queues = self._tenant_queues[req.priority]
        queue = queues[t]
        _take(queue, req)
        if not queue:
            del queues[t]
            if not queues:
                del self._tenant_queues[req.priority]

    def _pick(self, priority: int) -> Request:
        """The oldest request of the tenant in this class whose service, counting what its
        running requests may still sample, is least (ties: the oldest request)."""
        due = self.counters + self.committed
        queues = self._tenant_queues[priority].values()
        return min(queues, key=lambda q: (due[q[0].tenant_id], q[0].seq))[0]

    def on_admit(self, req: Request, max_outputs: int) -> None:
        super().on_admit(req, max_outputs)
        t = req.tenant_id
        self._running[t] += 1
        self.committed[t] += max_outputs * self.output_weight * self._inv_weight[t]

    def on_leave(self, req: Request, unsampled: int) -> None:
        t = req.tenant_id
        self._running[t] -= 1
        left = self.committed[t] - unsampled * self.output_weight * self._inv_weight[t]
        self.committed[t] = max(0.0, left)

    def charge_prompt(self, req: Request, num_tokens: int) -> None:
        super().charge_prompt(req, num_tokens)
        self.counters[req.tenant_id] += num_tokens * self._inv_weight[req.tenant_id]

    def charge_output_counts(self, tokens: np.ndarray) -> None:
        self.output_tokens += tokens
        charge = tokens * self.output_weight * self._inv_weight
        self.counters += charge
        np.maximum(self.committed - charge, 0.0, out=self.committed)

    def charge_rejected(self, tokens: np.ndarray) -> None:
        # why not from committed: it holds the outputs running requests may still sample,
        # and a rejected draft is not one of them
        self.output_tokens += tokens
        self.counters += tokens * self.output_weight * self._inv_weight


def make_policy(
    name: str,
    weights: dict[str, float] | None = None,
    output_weight: float = 2.0,
    aging_s: float = 30.0,
) -> Policy:
    if name == "fcfs":
        return Policy(aging_s)
    if name == "priority":
        return PriorityPolicy(aging_s)
    if name == "fair":
        return FairPolicy(weights, output_weight, aging_s)
    raise ValueError(f"unknown scheduling policy {name!r}: fair, priority or fcfs")
