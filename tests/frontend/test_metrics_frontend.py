"""The frontend's series: what one streamed request, a rejection and /metrics itself record."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import httpx
import pytest
from prometheus_client import CollectorRegistry

from gapless.core.common.config import EngineConfig
from gapless.frontend.app import App
from tests.frontend.conftest import MODEL, build_app, sse_events
from tests.frontend.fake_engine import FakeEngine
from tests.frontend.test_lifecycle import Call

pytestmark = pytest.mark.anyio


def _count(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return registry.get_sample_value(name, labels) or 0.0


async def test_a_streamed_request_moves_every_frontend_series(
    registry: CollectorRegistry, client: httpx.AsyncClient
) -> None:
    body = {"model": MODEL, "prompt": "one two three four", "max_tokens": 4, "stream": True}
    r = await client.post("/v1/completions", json=body)
    assert r.status_code == 200 and sse_events(r.text)[-1] == "[DONE]"
    stage = "gapless_stage_duration_seconds_count"
    assert _count(registry, stage, stage="tokenize") == 1
    assert _count(registry, stage, stage="stream") == 4  # one per delta
    assert _count(registry, "gapless_time_to_first_token_seconds_count") == 1
    assert _count(registry, "gapless_inter_token_latency_seconds_count") == 3
    assert _count(registry, "gapless_e2e_request_latency_seconds_count") == 1

    r = await client.post("/v1/completions", content=b"{not json")
    assert r.status_code == 400
    r = await client.post("/v1/completions", json={"model": "other", "prompt": "x"})
    assert r.status_code == 404
    assert _count(registry, "gapless_requests_rejected_total", reason="invalid_json") == 1
    assert _count(registry, "gapless_requests_rejected_total", reason="model_not_found") == 1


async def test_metrics_needs_no_api_key(
    registry: CollectorRegistry,
    make_config: Callable[..., EngineConfig],
    engine: FakeEngine,
) -> None:
    app = build_app(make_config(api_key="sekrit"), engine)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://test"
    ) as c:
        r = await c.get("/metrics")
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
        assert (await c.get("/v1/models")).status_code == 401
        assert (await c.post("/metrics")).status_code == 405
    assert _count(registry, "gapless_requests_rejected_total", reason="invalid_api_key") == 1


async def test_a_client_disconnect_counts_as_aborted(
    registry: CollectorRegistry, app: App, engine: FakeEngine
) -> None:
    engine.gate = asyncio.Event()  # deltas stop after the first
    call = Call(app, "/v1/completions", {"prompt": "a b c", "max_tokens": 3, "stream": True})
    assert b"data: " in await call.next_body()
    call.disconnect()
    await asyncio.wait_for(call.task, 1)
    assert _count(registry, "gapless_requests_aborted_total") == 1
    assert _count(registry, "gapless_e2e_request_latency_seconds_count") == 0
