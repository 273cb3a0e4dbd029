"""The frontend's series: what one streamed request, a rejection and /metrics itself record;
who reads which series, and the engine routes."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable

import httpx
import pytest
from prometheus_client import CollectorRegistry

from gapless.common import metrics as core_metrics
from gapless.common.config import EngineConfig
from gapless.core.metrics import CoreMetrics
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


# ------------------------------------------------------------------ who reads what

KEYS = {"sk-a": "a", "sk-b": "b", "sk-ops": "ops"}


@pytest.fixture
def engine_series(monkeypatch: pytest.MonkeyPatch) -> CollectorRegistry:
    """The core's series with two tenants' traffic, served by /metrics in place of the
    multiprocess files (which a served engine has)."""
    registry = CollectorRegistry()
    core = CoreMetrics(registry, known_tenants=("a", "b"))
    core.tenant_tokens.labels("a", "prompt").inc(11)
    core.tenant_tokens.labels("b", "prompt").inc(22)
    core.tenant_waiting.labels("b").set(3)
    core.running.set(4)
    core.blocks_total.set(100)
    render = core_metrics.render
    monkeypatch.setattr(core_metrics, "render", lambda _, *args: render(registry, *args))
    return registry


def _tenants(text: str) -> set[str]:
    return set(re.findall(r'tenant="([^"]*)"', text))


async def _get(c: httpx.AsyncClient, path: str, key: str | None = None) -> httpx.Response:
    return await c.get(path, headers={"authorization": f"Bearer {key}"} if key else {})


async def test_a_tenants_key_reads_only_its_own_metrics(
    engine_series, make_config: Callable[..., EngineConfig], engine: FakeEngine
) -> None:
    config = make_config(
        api_keys=KEYS, admin_keys=("sk-ops",), admin_api_key="root", metrics_require_key=True
    )
    transport = httpx.ASGITransport(app=build_app(config, engine))
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
        assert (await _get(c, "/metrics")).status_code == 401
        mine = (await _get(c, "/metrics", "sk-a")).text
        assert _tenants(mine) == {"a"}, mine
        assert 'gapless_tenant_service_tokens_total{kind="prompt",model_name' in mine
        assert "gapless_kv_blocks_total{" in mine, "the engine's size is no one's traffic"
        assert (
            "gapless_requests_running" not in mine and "gapless_tenant_requests_waiting" not in mine
        )
        assert _tenants((await _get(c, "/metrics", "sk-b")).text) == {"b"}
        for admin in ("sk-ops", "root"):
            everything = (await _get(c, "/metrics", admin)).text
            assert _tenants(everything) == {"a", "b"} and "gapless_requests_running{" in everything


async def test_an_open_metrics_shows_everything(
    engine_series, make_config: Callable[..., EngineConfig], engine: FakeEngine
) -> None:
    """Without --metrics-require-key /metrics stays open to scrapers, key or none."""
    transport = httpx.ASGITransport(app=build_app(make_config(api_keys=KEYS), engine))
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
        for key in (None, "sk-a"):
            assert _tenants((await _get(c, "/metrics", key)).text) == {"a", "b"}


def test_a_tenant_named_like_the_others_label_reads_none_of_them() -> None:
    registry = CollectorRegistry()
    CoreMetrics(registry, known_tenants=("a",)).tenant_tokens.labels("other", "prompt").inc(5)
    text = core_metrics.render(registry, None, "other").decode()
    assert "gapless_tenant_service_tokens" not in text
    assert "tenant=" not in core_metrics.render(registry, None, "a").decode()


@pytest.mark.parametrize("path", ["/v1/engine/stats", "/v1/engine/timeline"])
async def test_the_engine_routes_need_the_admin_key(
    path: str, make_config: Callable[..., EngineConfig], engine: FakeEngine
) -> None:
    engine.die("stopped for the test")  # past the key check the route answers 503 at once
    configs = {
        "keys file": make_config(api_keys=KEYS, admin_keys=("sk-ops",)),
        "--admin-api-key": make_config(api_keys=KEYS, admin_api_key="sk-ops"),
        "--api-key only": make_config(api_key="sk-a"),
    }
    for name, config in configs.items():
        transport = httpx.ASGITransport(app=build_app(config, engine))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            r = await _get(c, path, "sk-a")
            assert r.status_code == 403, (name, r.text)
            error = r.json()["error"]
            assert error["code"] == "admin_key_required" and "admin" in error["message"]
            assert error["type"] == "invalid_request_error"
            assert (await _get(c, path)).status_code == 401
            if name != "--api-key only":
                assert (await _get(c, path, "sk-ops")).status_code == 503, name
    # with no key configured nothing is kept from anyone
    transport = httpx.ASGITransport(app=build_app(make_config(), engine))
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
        assert (await _get(c, path)).status_code == 503
