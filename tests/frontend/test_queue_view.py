"""The frontend's count of queued requests: tickets, first deltas, QueueState and the drain rate."""

from __future__ import annotations

import asyncio

import pytest

from gapless.common.messages import (
    QueueState,
    SamplingParams,
    TextDelta,
    TextDeltas,
)
from gapless.frontend.engine.client import EngineClient
from gapless.frontend.engine.queue_view import QueueView
from tests.frontend.fake_engine import request_stream

PARAMS = SamplingParams(max_tokens=4)


def test_a_ticket_counts_until_each_choice_leaves() -> None:
    view = QueueView(0)
    ticket = view.take("acme", 3)
    assert (view.num_queued, view.num_queued_tokens, view.num_tenant_queued("acme")) == (3, 0, 3)
    ticket.set_prompt(10)
    assert view.num_queued_tokens == 30
    ticket.leave(started=True)
    assert (view.num_queued, view.num_queued_tokens, view.num_tenant_queued("acme")) == (2, 20, 2)
    with ticket:  # leaving the block releases the rest, once
        pass
    ticket.release()
    ticket.leave()
    assert (view.num_queued, view.num_queued_tokens, view.num_tenant_queued("acme")) == (0, 0, 0)
    assert view.starts.per_s() == pytest.approx(0.1)  # one start in the 10 s window


def test_tenants_leave_no_trace() -> None:
    """X-Tenant names tenants freely: the per-tenant dict holds only tenants with requests."""
    view = QueueView(0)
    for i in range(1000):
        view.take(f"t{i}", 2).release()
    assert view._tenants == {}


def test_queue_state_gives_the_other_frontends_part() -> None:
    view = QueueView(1)
    view.take("a", 2)
    state = QueueState([3, 100, 4], [30, 1000, 40], [{"a": 3}, {"a": 99, "b": 1}, {"b": 4}], 2.5)
    view.update(state)
    assert view.num_queued == 2 + 3 + 4  # its own from its tickets, never from QueueState
    assert view.num_queued_tokens == 70
    assert (view.num_tenant_queued("a"), view.num_tenant_queued("b")) == (5, 4)
    assert view.drain_per_s() == 2.5
    # a frontend the core does not know yet (lists shorter than its id) counts them all
    late = QueueView(5)
    late.update(state)
    assert late.num_queued == 107


@pytest.mark.anyio
async def test_the_engine_client_keeps_the_count() -> None:
    client = EngineClient(0, lambda msg: None)
    view = client.queue
    stream = request_stream(client, "r", [1, 2, 3], [PARAMS, PARAMS], tenant="t").deltas()
    first = asyncio.ensure_future(anext(stream))
    await asyncio.sleep(0)
    assert (view.num_queued, view.num_queued_tokens) == (2, 6)  # no ticket given: one taken
    assert set(view.unstarted) == {"r-0", "r-1"}
    client.dispatch(TextDeltas([TextDelta("r-1", "x", [5], 3, 1)]))  # r-1 started
    await first
    assert (view.num_queued, view.num_queued_tokens, list(view.unstarted)) == (1, 3, ["r-0"])
    client.dispatch(TextDeltas([TextDelta("r-1", "y", [6], 3, 2)]))  # a later delta: no change
    assert view.num_queued == 1
    await stream.aclose()  # the client leaves: r-0 is aborted and leaves the count
    assert (view.num_queued, view.num_queued_tokens, view.unstarted) == (0, 0, {})
    client.dispatch(QueueState([9, 4], [90, 40], [{"t": 9}, {"t": 4}], 1.0))
    assert (view.num_queued, view.num_tenant_queued("t")) == (4, 4)


@pytest.mark.anyio
async def test_an_end_without_tokens_is_no_start() -> None:
    client = EngineClient(0, lambda msg: None)
    ticket = client.queue.take("", 1)
    ticket.set_prompt(1)
    stream = request_stream(client, "r", [1], [PARAMS], ticket=ticket).deltas()
    first = asyncio.ensure_future(anext(stream))
    await asyncio.sleep(0)
    end = TextDelta("r-0", "", [], 1, 0, "error", None, "waited", "queue_timeout")
    client.dispatch(TextDeltas([end]))
    assert (await first)[1].code == "queue_timeout"
    assert client.queue.num_queued == 0 and client.queue.starts.per_s() == 0
