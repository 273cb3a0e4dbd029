"""Admission control at the frontend: request caps before tokenizing, the token cap after, 429s
with Retry-After, queue timeouts, 503 while draining or dead, and who may read /metrics."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry

from gapless.common.config import TenantSpec
from gapless.frontend.app import App
from gapless.frontend.engine.admission import retry_after_s
from gapless.launch.keys_file import read_keys_file
from tests.frontend.conftest import build_app, sse_events
from tests.frontend.fake_engine import FakeEngine

pytestmark = pytest.mark.anyio

TOKENIZE = "gapless_stage_duration_seconds_count"
DECISIONS = "gapless_admission_decision_seconds_count"
USER = [{"role": "user", "content": "hi"}]


def _count(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return registry.get_sample_value(name, labels) or 0.0


def _tokenized(registry: CollectorRegistry) -> float:
    return _count(registry, TOKENIZE, stage="tokenize")


@pytest.fixture
async def held(engine: FakeEngine) -> AsyncIterator[asyncio.Event]:
    """Requests sent to the fake engine stay queued until the event is set."""
    engine.hold = asyncio.Event()
    yield engine.hold
    engine.hold.set()


async def _eventually(cond: Callable[[], bool], timeout_s: float = 2.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not cond():
        assert loop.time() < deadline, "condition not met in time"
        await asyncio.sleep(0.002)


def _post(c: httpx.AsyncClient, body: dict[str, Any], **headers: str) -> asyncio.Task:
    """A completion request in flight; the task's result is the response."""
    body = {"prompt": "a b c", "max_tokens": 2, **body}
    return asyncio.ensure_future(c.post("/v1/completions", json=body, headers=headers))


async def _queue(c: httpx.AsyncClient, engine: FakeEngine, num: int, **body: Any) -> list:
    """`num` requests of n choices each, sent and held queued by the fake engine."""
    before = engine.queue.num_queued
    n = body.get("n", 1)
    tasks = [_post(c, body) for _ in range(num)]
    await _eventually(lambda: engine.queue.num_queued == before + num * n)
    await _eventually(lambda: len(engine.queue.unstarted) >= num * n)  # sent, not just admitted
    return tasks


def _error(r: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["code"] == code, error
    return error


async def test_the_request_cap_refuses_before_tokenizing(
    registry: CollectorRegistry, make_config, engine: FakeEngine, held: asyncio.Event
) -> None:
    app = build_app(make_config(max_queued_requests=3), engine)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        queued = await _queue(c, engine, 3)
        assert _tokenized(registry) == 3
        r = await c.post("/v1/completions", json={"prompt": "x y", "max_tokens": 2})
        error = _error(r, 429, "queue_full")
        assert error["type"] == "requests"
        assert (
            "3 requests wait for a seat and the cap is 3 (--max-queued-requests)"
            in (error["message"])
        )
        assert int(r.headers["retry-after"]) >= 1
        chat = {"messages": USER, "max_tokens": 2}
        _error(await c.post("/v1/chat/completions", json=chat), 429, "queue_full")
        assert _tokenized(registry) == 3  # neither refused request was tokenized
        assert len(engine.added) == 3

        held.set()  # the queue drains: requests are admitted again
        assert [(await t).status_code for t in queued] == [200] * 3
        assert (await c.post("/v1/chat/completions", json=chat)).status_code == 200
    assert _count(registry, "gapless_requests_rejected_total", reason="queue_full") == 2
    assert _count(registry, DECISIONS) == 6  # every request that reached the decision


async def test_each_choice_counts(make_config, engine: FakeEngine, held) -> None:
    app = build_app(make_config(max_queued_requests=4), engine)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        queued = await _queue(c, engine, 1, n=3)
        r = await c.post("/v1/completions", json={"prompt": "x", "n": 2})
        _error(r, 429, "queue_full")
        queued += await _queue(c, engine, 1, n=1)  # 3 + 1 fits
        held.set()
        assert [(await t).status_code for t in queued] == [200, 200]
    assert engine.queue.num_queued == 0 and not engine.queue.unstarted


async def test_a_request_larger_than_the_cap_runs_alone(make_config, engine, held) -> None:
    app = build_app(make_config(max_queued_requests=1, max_queued_tokens=2), engine)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        first = await _queue(c, engine, 1, n=2, prompt="many words in this prompt")
        r = await c.post("/v1/completions", json={"prompt": "x"})
        _error(r, 429, "queue_full")
        held.set()
        assert (await first[0]).status_code == 200


async def test_the_token_cap_refuses_after_tokenizing(
    registry: CollectorRegistry, make_config, engine: FakeEngine, held
) -> None:
    app = build_app(make_config(max_queued_tokens=20), engine)
    prompt = "one two three four five six seven eight"  # 8 tokens
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        queued = await _queue(c, engine, 1, prompt=prompt, n=2)
        assert engine.queue.num_queued_tokens == 16
        r = await c.post("/v1/completions", json={"prompt": "nine ten eleven twelve five"})
        error = _error(r, 429, "queue_tokens_full")
        assert error["type"] == "tokens"
        assert error["message"].startswith(
            "16 prompt tokens wait for a seat, this request adds 5, and the cap is 20 "
            "(--max-queued-tokens)"
        )
        assert "retry-after" in r.headers
        assert _tokenized(registry) == 2  # the refused request was tokenized first
        assert len(engine.added) == 2  # but never reached the engine
        queued += await _queue(c, engine, 1, prompt="nine ten eleven twelve")  # 16 + 4 fits
        held.set()
        assert [(await t).status_code for t in queued] == [200, 200]
    assert _count(registry, "gapless_requests_rejected_total", reason="queue_tokens_full") == 1
    assert _count(registry, DECISIONS) == 3
    assert engine.queue.num_queued_tokens == 0


async def test_the_tenant_cap_comes_from_the_keys_file(
    tmp_path, make_config, engine: FakeEngine, held
) -> None:
    path = tmp_path / "keys.json"
    keys_file = {"sk-a": "acme", "sk-b": {"tenant": "beta", "max_queued_requests": 2}}
    path.write_text(json.dumps(keys_file))
    keys, tenants, _ = read_keys_file(str(path))
    app = build_app(make_config(api_keys=keys, tenants=tenants), engine)
    beta, acme = {"authorization": "Bearer sk-b"}, {"authorization": "Bearer sk-a"}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        queued = [_post(c, {}, **beta), _post(c, {}, **beta)]
        await _eventually(lambda: engine.queue.num_tenant_queued("beta") == 2)
        r = await c.post("/v1/completions", json={"prompt": "x"}, headers=beta)
        error = _error(r, 429, "tenant_queue_full")
        assert error["message"].startswith(
            "tenant 'beta' has 2 requests waiting for a seat and its cap is 2 "
            "(max_queued_requests in --api-keys-file)"
        )
        assert "retry-after" in r.headers
        queued += [_post(c, {}, **acme) for _ in range(3)]  # acme has no cap
        await _eventually(lambda: engine.queue.num_queued == 5)
        held.set()
        assert [(await t).status_code for t in queued] == [200] * 5
    assert engine.queue.num_tenant_queued("beta") == 0


async def test_other_frontends_queued_requests_count(make_config, engine: FakeEngine) -> None:
    """Frontend 0 counts what QueueState says of frontends 1 and 2, never its own entry."""
    config = make_config(
        max_queued_requests=10,
        tenants={"acme": TenantSpec(max_queued_requests=3)},
        api_servers=3,
    )
    app = build_app(config, engine)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        engine.queue_state([50, 4, 5])
        assert engine.queue.num_queued == 9
        assert (await c.post("/v1/completions", json={"prompt": "x"})).status_code == 200
        r = await c.post("/v1/completions", json={"prompt": "x", "n": 2})
        _error(r, 429, "queue_full")

        engine.queue_state([50, 1, 1], tenants=[{"acme": 50}, {"acme": 1}, {"acme": 1}])
        acme = {"prompt": "x", "user": "acme"}
        assert (await c.post("/v1/completions", json=acme)).status_code == 200
        _error(await c.post("/v1/completions", json={**acme, "n": 2}), 429, "tenant_queue_full")
        engine.queue_state([0, 0, 0])
        assert (await c.post("/v1/completions", json={**acme, "n": 2})).status_code == 200


@pytest.mark.parametrize(
    ("excess", "rate", "seconds"),
    [(7, 2.0, 4), (1, 1.0, 1), (0.5, 10.0, 1), (-3, 1.0, 1), (1000, 1.0, 60), (1, 0.0, 60)],
)
def test_retry_after(excess, rate, seconds) -> None:
    assert retry_after_s(excess, rate) == seconds


@pytest.mark.parametrize(
    ("waiting", "drain_per_s", "retry_after"),
    [
        (10, 2.0, 4),  # 10 + 1 - 4 = 7 must drain at 2/s: 3.5 s, rounded up
        (10, 100.0, 1),  # at least 1
        (10, 0.05, 60),  # at most 60
        (10, 0.0, 60),  # nothing drains (and nothing started here)
        (4, 0.5, 2),  # 4 + 1 - 4 = 1 at 0.5/s
    ],
)
async def test_retry_after_follows_the_drain_rate(
    make_config, engine: FakeEngine, waiting, drain_per_s, retry_after
) -> None:
    app = build_app(make_config(max_queued_requests=4, api_servers=2), engine)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        engine.queue_state([0, waiting], drain_per_s=drain_per_s)
        r = await c.post("/v1/completions", json={"prompt": "x"})
        error = _error(r, 429, "queue_full")
        assert r.headers["retry-after"] == str(retry_after)
        assert error["message"].endswith(f"retry after {retry_after} s")


async def test_retry_after_falls_back_to_this_frontends_start_rate(make_config, engine) -> None:
    app = build_app(make_config(max_queued_requests=4, api_servers=2), engine)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        for _ in range(5):  # 5 starts in the last 10 s: 0.5 per second
            assert (await c.post("/v1/completions", json={"prompt": "x"})).status_code == 200
        engine.queue_state([0, 10], drain_per_s=0.0)
        r = await c.post("/v1/completions", json={"prompt": "x"})
        assert r.headers["retry-after"] == "14"  # 7 over the cap at 0.5/s


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_a_queue_timeout_is_a_429(
    registry, make_config, engine: FakeEngine, held, path
) -> None:
    app = build_app(make_config(max_queue_wait_s=1.0, api_servers=2), engine)
    body = {"prompt": "a b"} if path == "/v1/completions" else {"messages": USER}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        for stream in (False, True):
            task = asyncio.ensure_future(c.post(path, json={**body, "stream": stream}))
            await _eventually(lambda: len(engine.queue.unstarted) == 1)
            # 20 wait elsewhere, 4/s drain: 4 of them fit in the 1 s wait, 16 / 4 = 4 s
            engine.queue_state([0, 20], drain_per_s=4.0)
            engine.time_out(next(iter(engine.queue.unstarted)))
            r = await task
            error = _error(r, 429, "queue_timeout")
            assert error["type"] == "requests"
            assert "longer than --max-queue-wait 1 s" in error["message"]
            assert r.headers["retry-after"] == "4"
    assert _count(registry, "gapless_requests_rejected_total", reason="queue_timeout") == 2
    assert engine.queue.num_queued == 20  # the 20 of the other frontend; none of ours


async def test_a_queue_timeout_after_the_stream_began_is_an_error_event(
    make_config, engine: FakeEngine, held
) -> None:
    """n=2: choice 0 streams, choice 1 waits and times out."""
    engine.held = lambda request_id: request_id.endswith("-1")
    engine.gate = asyncio.Event()  # choice 0 stops after its first delta
    app = build_app(make_config(max_queue_wait_s=1.0), engine)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        body = {"messages": USER, "n": 2, "stream": True, "max_tokens": 4}
        task = asyncio.ensure_future(c.post("/v1/chat/completions", json=body))
        await _eventually(lambda: len(engine.queue.unstarted) == 1)
        (late,) = engine.queue.unstarted
        assert late.endswith("-1")
        engine.time_out(late)
        r = await task
    assert r.status_code == 200
    events = sse_events(r.text)
    assert events[0]["choices"][0]["index"] == 0  # the stream began with choice 0
    assert events[-1] == "[DONE]"
    error = events[-2]["error"]
    assert error["code"] == "queue_timeout" and error["type"] == "requests"
    assert sorted(engine.aborted) == [late.removesuffix("-1") + "-0"]  # choice 0 stopped too


async def test_503_with_retry_after_while_draining(
    registry, app: App, client: httpx.AsyncClient, engine
) -> None:
    app.state.admission.draining = True
    for path, body in (
        ("/v1/completions", {"prompt": "x"}),
        ("/v1/chat/completions", {"messages": USER}),
    ):
        r = await client.post(path, json=body)
        error = _error(r, 503, "draining")
        assert error["type"] == "server_error" and r.headers["retry-after"] == "5"
    r = await client.get("/health")
    assert r.status_code == 503 and r.json()["status"] == "draining"
    assert engine.added == []
    assert _count(registry, DECISIONS) == 2


async def test_503_with_retry_after_when_the_engine_is_dead(client, engine: FakeEngine) -> None:
    engine.die("core crashed")
    r = await client.post("/v1/completions", json={"prompt": "x"})
    error = _error(r, 503, "engine_unavailable")
    assert "core crashed" in error["message"] and r.headers["retry-after"] == "5"


async def test_a_request_that_fails_after_admission_leaves_the_count(
    make_config, engine: FakeEngine
) -> None:
    app = build_app(make_config(max_queued_requests=2), engine)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        too_long = {"prompt": "x " * 300, "max_tokens": 2}  # past the 256-token context
        assert (await c.post("/v1/completions", json=too_long)).status_code == 400
        assert (await c.post("/v1/completions", json={"prompt": ""})).status_code == 400
    assert engine.queue.num_queued == 0 and not engine.queue._tenants


async def test_metrics_require_key(registry, make_config, engine: FakeEngine) -> None:
    app = build_app(make_config(api_key="sekrit", metrics_require_key=True), engine)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        r = await c.get("/metrics")
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = await c.get("/metrics", headers={"authorization": "Bearer sekrit"})
        assert r.status_code == 200
        assert (await c.get("/health")).status_code == 200
