"""Admission control: whether a request may join the engine's queue, decided at the frontend.

The request caps (--max-queued-requests, the tenant's max_queued_requests) are decided before
tokenizing, so a flood is refused for the price of parsing its bodies; the token cap
(--max-queued-tokens) right after tokenizing. Over a cap: 429 with a Retry-After estimated from
how fast the queue drains. While draining or with the engine dead: 503 with a Retry-After.
"""

from __future__ import annotations

import math
import time

from gapless.common.config import EngineConfig
from gapless.frontend.engine.client import EngineClient
from gapless.frontend.engine.queue_view import QueueView, Ticket
from gapless.frontend.http import metrics
from gapless.frontend.http.errors import UNAVAILABLE_RETRY_AFTER_S, ApiError, engine_unavailable

MAX_RETRY_AFTER_S = 60  # the most any estimate says: clients retry sooner and look again


def retry_after_s(excess: float, drain_per_s: float) -> int:
    """Seconds until `excess` queued requests have left at `drain_per_s`, from 1 to 60; 60
    when nothing drains."""
    if drain_per_s <= 0:
        return MAX_RETRY_AFTER_S
    return min(MAX_RETRY_AFTER_S, max(1, math.ceil(excess / drain_per_s)))


def too_many(code: str, kind: str, message: str, retry_s: int) -> ApiError:
    """429 in OpenAI's shape: type "requests" or "tokens", our code, and Retry-After."""
    return ApiError(
        429,
        f"{message}; retry after {retry_s} s",
        code=code,
        type=kind,
        headers=[(b"retry-after", str(retry_s).encode())],
    )


class Admission:
    """One frontend's admission decisions over its engine client's QueueView."""

    def __init__(self, config: EngineConfig, engine: EngineClient) -> None:
        self.config = config
        self.engine = engine
        self.queue: QueueView = engine.queue
        self.draining = False  # set on SIGTERM: in-flight requests finish, new ones get 503

    def admit(self, tenant: str, n: int, received: float) -> Ticket:
        """Before tokenizing: a Ticket that counts the request's n choices as queued from now
        on, or 503 / 429. Release the ticket when the request ends (`with` does). `received`:
        time.perf_counter() when the request's body was in, where the decision's clock starts."""
        try:
            self._check_open()
            self._check_requests(tenant, n)
        except ApiError:
            metrics.observer.admission_decided(time.perf_counter() - received)
            raise
        if self.config.max_queued_tokens is None:  # this was the whole decision
            metrics.observer.admission_decided(time.perf_counter() - received)
        return self.queue.take(tenant, n)

    def admit_tokens(self, ticket: Ticket, num_prompt_tokens: int, received: float) -> None:
        """After tokenizing: the prompt's tokens join the count, or 429 past the token cap."""
        cap = self.config.max_queued_tokens
        if cap is None:
            ticket.set_prompt(num_prompt_tokens)
            return
        try:
            queue, n = self.queue, ticket.num_queued
            queued, adding = queue.num_queued_tokens, num_prompt_tokens * n
            others = queue.num_queued - n  # requests queued besides this one
            if others > 0 and queued + adding > cap:
                # requests to drain first: the excess in tokens over the mean queued prompt
                excess = math.ceil((queued + adding - cap) / max(1.0, queued / others))
                raise too_many(
                    "queue_tokens_full",
                    "tokens",
                    f"{queued} prompt tokens wait for a seat, this request adds {adding}, and "
                    f"the cap is {cap} (--max-queued-tokens)",
                    retry_after_s(excess, queue.drain_per_s()),
                )
        finally:
            metrics.observer.admission_decided(time.perf_counter() - received)
        ticket.set_prompt(num_prompt_tokens)

    def queue_timeout(self, reason: str) -> ApiError:
        """429 for a request the core ended after --max-queue-wait: retry once the queue is
        short enough to be served within that wait at the present drain rate."""
        rate = self.queue.drain_per_s()
        wait_s = self.config.max_queue_wait_s or 0.0
        excess = self.queue.num_queued - rate * wait_s  # requests past what drains in wait_s
        retry_s = retry_after_s(excess, rate)
        return too_many("queue_timeout", "requests", f"the engine is overloaded: {reason}", retry_s)

    def _check_open(self) -> None:
        if not self.engine.healthy:
            raise engine_unavailable(self.engine.dead_reason)
        if self.draining:
            raise ApiError(
                503,
                "this server is shutting down and takes no new requests",
                code="draining",
                headers=[(b"retry-after", str(UNAVAILABLE_RETRY_AFTER_S).encode())],
            )

    def _check_requests(self, tenant: str, n: int) -> None:
        """A request bigger than a cap by itself is admitted when nothing of its kind is
        queued: refused, it could never be served."""
        queue = self.queue
        cap = self.config.max_queued_requests
        queued = queue.num_queued
        if cap is not None and queued > 0 and queued + n > cap:
            raise too_many(
                "queue_full",
                "requests",
                f"{queued} requests wait for a seat and the cap is {cap} (--max-queued-requests)",
                retry_after_s(queued + n - cap, queue.drain_per_s()),
            )
        spec = self.config.tenants.get(tenant)
        cap = spec.max_queued_requests if spec is not None else None
        if cap is None:
            return
        queued = queue.num_tenant_queued(tenant)
        if queued > 0 and queued + n > cap:
            raise too_many(
                "tenant_queue_full",
                "requests",
                f"tenant {tenant!r} has {queued} requests waiting for a seat and its cap is "
                f"{cap} (max_queued_requests in --api-keys-file)",
                retry_after_s(queued + n - cap, queue.drain_per_s()),
            )
