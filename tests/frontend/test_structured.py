"""response_format reaches the engine as a checked grammar; a schema that cannot be used is a
400 naming it."""

from __future__ import annotations

import asyncio
import os
import resource
import signal
import time

import httpx
import llguidance
import pytest

from gapless.common.grammars import json_grammar
from tests.frontend.conftest import build_app
from tests.frontend.hostile_schemas import alive, runaway_schema, wait_gone
from tests.timing import late_limit_s

pytestmark = pytest.mark.anyio
USER = [{"role": "user", "content": "one two three"}]
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "n": {"type": "integer"}},
    "required": ["city", "n"],
    "additionalProperties": False,
}


def json_format(schema: object, strict: bool | None = True) -> dict:
    spec = {"name": "answer", "schema": schema}
    if strict is not None:
        spec["strict"] = strict
    return {"type": "json_schema", "json_schema": spec}


def accepts(grammar: str, text: str, tokenizer) -> bool:
    from gapless.common.grammars import make_tokenizer

    view = make_tokenizer(tokenizer.to_str(), 49152, (2,))
    matcher = llguidance.LLMatcher(view, grammar)
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    return all(matcher.consume_token(t) for t in ids) and matcher.consume_token(2)


async def test_json_schema_becomes_a_compact_grammar(client: httpx.AsyncClient, engine) -> None:
    body = {"messages": USER, "response_format": json_format(SCHEMA)}
    r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    grammar = engine.added[0].params.grammar
    assert grammar is not None
    assert accepts(grammar, '{"city":"Paris","n":3}', engine.tokenizer)
    assert not accepts(grammar, '{"city": "Paris", "n": 3}', engine.tokenizer)  # compact only
    assert not accepts(grammar, '{"city":"Paris"}', engine.tokenizer)


async def test_json_object_and_text(client: httpx.AsyncClient, engine) -> None:
    for fmt in ({"type": "json_object"}, {"type": "text"}):
        r = await client.post(
            "/v1/chat/completions", json={"messages": USER, "response_format": fmt}
        )
        assert r.status_code == 200, r.text
    json_object, text = (a.params.grammar for a in engine.added)
    assert text is None and json_object is not None
    assert accepts(json_object, '{"a":[1,2]}', engine.tokenizer)
    assert not accepts(json_object, "[1,2]", engine.tokenizer)


@pytest.mark.parametrize(
    "fmt",
    [
        json_format({"type": "string", "pattern": "(("}),
        json_format({"type": "object", "properties": {"a": {"type": "string", "format": "zz"}}}),
        json_format("not a schema"),
    ],
)
async def test_unusable_schema_is_a_400_naming_it(client: httpx.AsyncClient, engine, fmt) -> None:
    r = await client.post("/v1/chat/completions", json={"messages": USER, "response_format": fmt})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "response_format.json_schema.schema"
    assert "response_format.json_schema.schema" in error["message"]
    assert engine.added == []


async def test_strict_false_ignores_what_the_engine_lacks(client: httpx.AsyncClient, engine):
    schema = {"type": "object", "properties": {"a": {"type": "string", "format": "zz"}}}
    r = await client.post(
        "/v1/chat/completions",
        json={"messages": USER, "response_format": json_format(schema, strict=False)},
    )
    assert r.status_code == 200, r.text


async def test_unknown_response_format_type_is_a_400(client: httpx.AsyncClient) -> None:
    r = await client.post(
        "/v1/chat/completions", json={"messages": USER, "response_format": {"type": "xml"}}
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format.type"


@pytest.mark.parametrize(
    ("schema", "keyword"),
    [
        ({"type": "string", "x-foo": 1}, "'x-foo' at #"),
        ({"type": "string", "contentEncoding": "base64"}, "'contentEncoding' at #"),
        (
            {"type": "object", "properties": {"a": {"type": "string", "x-guidance": {}}}},
            "'x-guidance' at #/properties/a",
        ),
        (
            {"type": "array", "items": {"type": "integer", "nullable": True}},
            "'nullable' at #/items",
        ),
    ],
)
async def test_strict_refuses_what_the_engine_would_ignore(client, engine, schema, keyword):
    r = await client.post(
        "/v1/chat/completions", json={"messages": USER, "response_format": json_format(schema)}
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "response_format.json_schema.schema"
    assert keyword in error["message"], error["message"]
    r = await client.post(
        "/v1/chat/completions",
        json={"messages": USER, "response_format": json_format(schema, strict=None)},
    )
    assert r.status_code == 200, r.text  # without strict it is ignored
    assert len(engine.added) == 1


async def test_strict_keeps_annotations(client: httpx.AsyncClient, engine) -> None:
    from pydantic import BaseModel, Field

    class City(BaseModel):
        name: str = Field(description="its name", examples=["Paris"])
        people: int = 0

    r = await client.post(
        "/v1/chat/completions",
        json={"messages": USER, "response_format": json_format(City.model_json_schema())},
    )
    assert r.status_code == 200, r.text


async def test_boolean_schemas(client: httpx.AsyncClient, engine) -> None:
    r = await client.post(
        "/v1/chat/completions", json={"messages": USER, "response_format": json_format(True)}
    )
    assert r.status_code == 200, r.text
    grammar = engine.added[0].params.grammar
    for text in ('{"a":[1,2]}', "[1,2]", '"x"', "3", "null"):  # any JSON value
        assert accepts(grammar, text, engine.tokenizer), text
    assert not accepts(grammar, "{a}", engine.tokenizer)
    r = await client.post(
        "/v1/chat/completions", json={"messages": USER, "response_format": json_format(False)}
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "response_format.json_schema.schema"
    assert "no output can match" in error["message"]


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def proc_cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


# a runaway schema ends at whichever of the two bounds (`bounded`'s 1 s, the default 256 MiB) a
# machine reaches first: either verdict is right (tests/frontend/test_grammar_pool.py provokes
# each on purpose)
RUNAWAY_VERDICTS = ("did not compile within 1 s", "needs more than the 256 MiB")


async def workers_ready(pool) -> None:
    """Both of the pool's workers up and idle: a compile of two tenants at once takes one worker
    each, and waits for a replacement to have started."""
    grammar = json_grammar({"type": "string"}, strict=True)
    assert await asyncio.gather(*(pool.compile(grammar, f"ready-{i}") for i in range(2))) == [
        "",
        "",
    ]


@pytest.fixture
async def bounded(make_config, engine):
    """A client of an app whose compiles stop at 1 s, and the app's grammar pool."""
    app = build_app(make_config(grammar_timeout_s=1.0), engine)
    grammars = app.state.prompter.grammars
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=30) as c:
        yield c, grammars.pool
    grammars.close()


async def test_runaway_schema_is_a_400_and_the_frontend_comes_back_to_rest(bounded) -> None:
    client, pool = bounded
    fmt = json_format(runaway_schema(), strict=False)
    ok = await client.post(
        "/v1/chat/completions", json={"messages": USER, "response_format": json_format(SCHEMA)}
    )
    assert ok.status_code == 200, ok.text
    rss0 = rss_mb(os.getpid()) + sum(rss_mb(p) for p in pool.worker_pids)
    t0 = time.monotonic()
    body = {"messages": USER, "response_format": fmt}
    request = asyncio.ensure_future(client.post("/v1/chat/completions", json=body))
    await asyncio.sleep(0.5)
    compiling = set(pool.worker_pids)
    r = await request
    took = time.monotonic() - t0
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "response_format.json_schema.schema"
    assert any(verdict in error["message"] for verdict in RUNAWAY_VERDICTS), error
    assert took < late_limit_s(1.0), took
    assert any(wait_gone(p, late_limit_s(0)) for p in compiling)  # its worker was killed
    await workers_ready(pool)
    workers = pool.worker_pids
    assert workers and all(alive(p) for p in workers)
    cpu0, worker_cpu0, wall0 = cpu_s(), sum(map(proc_cpu_s, workers)), time.monotonic()
    await asyncio.sleep(1.0)
    wall = time.monotonic() - wall0
    assert (cpu_s() - cpu0) / wall < 0.2  # no thread compiles on in the frontend
    assert (sum(map(proc_cpu_s, workers)) - worker_cpu0) / wall < 0.2  # nor in a worker
    rss1 = rss_mb(os.getpid()) + sum(rss_mb(p) for p in workers)
    assert rss1 - rss0 < 300, (rss0, rss1)
    # the verdict is kept: a repeat reaches no worker (a compile would end one)
    again = await client.post("/v1/chat/completions", json=body)
    assert again.status_code == 400 and again.json() == r.json()
    assert pool.worker_pids == workers and all(alive(p) for p in workers)


async def test_the_drain_cut_ends_a_compile_in_flight(make_config, engine) -> None:
    """SIGTERM's drain: a request still compiling when the drain runs out gets its 503 then,
    not when its compile would have ended (its workers are stopped, its deadline a minute
    away)."""
    import uvicorn

    from gapless.frontend.server import _Server

    app = build_app(make_config(grammar_timeout_s=60.0), engine)
    grammars = app.state.prompter.grammars
    transport = httpx.ASGITransport(app=app)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=90) as c:
            await workers_ready(grammars.pool)
            for pid in grammars.pool.worker_pids:
                os.kill(pid, signal.SIGSTOP)
            body = {"messages": USER, "response_format": json_format(SCHEMA)}
            request = asyncio.ensure_future(c.post("/v1/chat/completions", json=body))
            await asyncio.sleep(0.3)
            assert not request.done()
            server = _Server(uvicorn.Config(None), None, engine, 0.1, grammars)  # type: ignore[arg-type]
            server.cut()
            r = await asyncio.wait_for(request, late_limit_s(0))
    finally:
        grammars.close()
    assert r.status_code == 503, r.text
    assert "shutting down" in r.json()["error"]["message"]


async def test_ten_runaway_schemas_leave_chat_requests_unharmed(bounded, engine) -> None:
    client, pool = bounded

    async def hostile(i: int) -> int:
        fmt = json_format(runaway_schema(10 + i), strict=False)
        body = {"messages": USER, "response_format": fmt}
        r = await client.post("/v1/chat/completions", json=body)
        return r.status_code

    async def ordinary(n: int) -> list[tuple[int, float, bool]]:
        """(status, seconds, whether the attack was still on as it ended) per request."""
        out = []
        for i in range(n):
            body = {"messages": [{"role": "user", "content": f"hello number {i}"}]}
            if i % 2:  # a schema compiled once already, and plain text
                body["response_format"] = {"type": "json_object"}
            t0 = time.monotonic()
            r = await client.post("/v1/chat/completions", json=body)
            out.append((r.status_code, time.monotonic() - t0, not attack.done()))
            await asyncio.sleep(0.05)
        return out

    first = await client.post(
        "/v1/chat/completions",
        json={"messages": USER, "response_format": {"type": "json_object"}},
    )
    assert first.status_code == 200
    t0 = time.monotonic()
    attack = asyncio.gather(*(hostile(i) for i in range(10)))
    chats = await ordinary(30)
    codes = await attack
    took = time.monotonic() - t0
    assert all(code in (400, 429) for code in codes), codes
    assert codes.count(400) >= 1
    assert [c for c, _, _ in chats] == [200] * 30
    # why not a speed: the attack lasts at least the 1 s a compile may wait; chats that queued
    # behind it would all end after it
    assert any(during for _, _, during in chats), chats
    slowest = max(t for _, t, _ in chats)
    assert slowest < late_limit_s(0), slowest
    # each hostile request ends within its wait (1 s) and its compile's deadline (1 s)
    assert took < late_limit_s(2.0), took
    await workers_ready(pool)
    workers = pool.worker_pids
    assert len(workers) <= 2
    cpu0, worker_cpu0, wall0 = cpu_s(), sum(map(proc_cpu_s, workers)), time.monotonic()
    await asyncio.sleep(1.0)
    wall = time.monotonic() - wall0
    assert (cpu_s() - cpu0) / wall < 0.2
    assert (sum(map(proc_cpu_s, workers)) - worker_cpu0) / wall < 0.2
