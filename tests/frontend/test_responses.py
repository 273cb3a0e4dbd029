"""POST /v1/responses and the stored responses through the official openai client, against the
app on a real uvicorn (in a thread) over the fake engine, which echoes the prompt's words or
plays a script; the prompts it was sent show what a continued response stands on."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterator

import httpx
import openai
import pytest

from gapless.frontend.api.responses_store import open_store
from tests.frontend.conftest import MODEL, served
from tests.frontend.fake_engine import FakeEngine

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "the weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


@pytest.fixture(scope="module")
def engine(hf_tokenizer) -> FakeEngine:
    return FakeEngine(hf_tokenizer[0])


@pytest.fixture(scope="module")
def base_url(make_config, engine: FakeEngine, tmp_path_factory) -> Iterator[str]:
    store = tmp_path_factory.mktemp("responses") / "responses.sqlite"
    with served(make_config(responses_store=str(store)), engine) as port:
        yield f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key="k", max_retries=0, timeout=10)


@pytest.fixture(autouse=True)
def _unscripted(engine: FakeEngine) -> Iterator[None]:
    yield
    engine.script = engine.finish_with = None
    engine.delay_s = 0.0


def _prompt(engine: FakeEngine) -> str:
    return engine.tokenizer.decode(engine.added[-1].prompt_token_ids, skip_special_tokens=False)


def test_a_string_and_items_whole(client: openai.OpenAI, engine: FakeEngine) -> None:
    r = client.responses.create(model=MODEL, input="red green blue", max_output_tokens=2)
    assert r.object == "response" and r.id.startswith("resp_") and len(r.id) >= 5 + 32
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output[0].type == "message" and r.output_text.split()[0] in _prompt(engine)
    assert r.usage.output_tokens == 2
    assert r.usage.total_tokens == r.usage.input_tokens + 2
    assert r.usage.input_tokens == len(engine.added[-1].prompt_token_ids)
    items = [
        {"role": "developer", "content": "be brief"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "one"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "two"}]},
        {"role": "user", "content": "three"},
    ]
    r = client.responses.create(model=MODEL, input=items, instructions="sys words")
    prompt = _prompt(engine)
    for word in ("sys words", "be brief", "one", "two", "three"):
        assert word in prompt
    assert prompt.index("sys words") < prompt.index("be brief") < prompt.index("three")
    assert r.status == "completed" and r.instructions == "sys words"


def test_the_series_and_the_access_line_count_it(client: openai.OpenAI, registry, caplog) -> None:
    caplog.set_level(logging.INFO, logger="gapless.access")
    whole = client.responses.create(model=MODEL, input="one two three")
    events = list(client.responses.create(model=MODEL, input="one two three", stream=True))
    output_tokens = [whole.usage.output_tokens, events[-1].response.usage.output_tokens]
    assert registry.get_sample_value("gapless_time_to_first_token_seconds_count") == 2
    assert registry.get_sample_value("gapless_e2e_request_latency_seconds_count") == 2
    lines = [
        rec.fields
        for rec in caplog.records
        if rec.name == "gapless.access" and rec.fields["route"] == "/v1/responses"
    ]
    assert [line["status"] for line in lines] == [200, 200]
    assert [line["completion_tokens"] for line in lines] == output_tokens
    assert all(line["finish_reason"] == "stop" and line["ttft_ms"] is not None for line in lines)


def test_streamed_events_and_the_final_response(client: openai.OpenAI) -> None:
    with client.responses.stream(model=MODEL, input="alpha beta gamma") as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    text = "".join(d.delta for d in deltas)
    assert final.output_text == text and events[-1].response.output_text == text
    item = final.output[0].id
    assert all(d.item_id == item and d.output_index == 0 and d.content_index == 0 for d in deltas)
    assert final.usage.output_tokens == len(deltas)
    # the same events through create(stream=True)
    again = list(client.responses.create(model=MODEL, input="alpha beta gamma", stream=True))
    assert [e.type for e in again] == kinds


def test_a_failure_mid_stream_is_an_error_event_then_failed(base_url: str, engine) -> None:
    """An engine failure ends the stream with `error` and response.failed (no [DONE]), after
    the first token or before it: response.created went out as the request was admitted."""
    engine.finish_with, engine.fail_at = "error", 2
    url, body = base_url + "/v1/responses", {"input": "one two three four", "stream": True}
    with httpx.stream("POST", url, json=body, timeout=10) as r:
        text = r.read().decode()
    data = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ")]
    assert [d["type"] for d in data[-2:]] == ["error", "response.failed"]
    assert data[-2]["code"] == "engine_error" and "[DONE]" not in text
    failed = data[-1]["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "engine_error"
    assert [d["sequence_number"] for d in data] == list(range(len(data)))
    engine.fail_at = 0
    with httpx.stream("POST", url, json=body, timeout=10) as r:
        assert r.status_code == 200
        text = r.read().decode()
    data = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ")]
    kinds = ["response.created", "response.in_progress", "error", "response.failed"]
    assert [d["type"] for d in data] == kinds and data[2]["code"] == "engine_error"


def test_keepalives_before_the_first_token_keep_the_events(make_config, engine) -> None:
    """response.created and response.in_progress go out at once; a first token that comes
    past --sse-keepalive is preceded by comments, and the events stay numbered from 0."""
    engine.delay_s = 0.3
    with served(make_config(sse_keepalive_s=0.05), engine) as port:
        body = {"input": "one two", "stream": True, "max_output_tokens": 1}
        url = f"http://127.0.0.1:{port}/v1/responses"
        with httpx.stream("POST", url, json=body, timeout=10) as r:
            text = r.read().decode()
    assert text.startswith("event: response.created\n")
    opening = text.index("event: response.in_progress")
    assert text.index(": keep-alive") > opening
    assert text.index(": keep-alive") < text.index("event: response.output_item.added")
    data = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ")]
    assert data[0]["type"] == "response.created" and data[-1]["type"] == "response.incomplete"
    assert [d["sequence_number"] for d in data] == list(range(len(data)))


def test_a_forced_call_then_its_output_continues(client: openai.OpenAI, engine: FakeEngine):
    engine.script = [CALL]
    r = client.responses.create(
        model=MODEL,
        input="weather in Paris?",
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
    )
    assert engine.added[-1].params.grammar, "a named tool choice is constrained"
    [call] = r.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Paris"}
    assert r.tools[0].strict is True  # a function without strict is strict
    engine.script = None
    follow = client.responses.create(
        model=MODEL,
        previous_response_id=r.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21C"}],
        tools=[WEATHER],
    )
    prompt = _prompt(engine)
    assert "weather in Paris?" in prompt and '"city": "Paris"' in prompt and "get_weather" in prompt
    assert "<tool_response>\nsunny, 21C\n</tool_response>" in prompt
    assert follow.previous_response_id == r.id
    types = [it.type for it in client.responses.input_items.list(follow.id, order="asc").data]
    assert types == ["message", "function_call", "function_call_output"]


def test_a_streamed_call(client: openai.OpenAI, engine: FakeEngine) -> None:
    engine.script = ["<tool_call>", CALL[len("<tool_call>") :]]
    events = list(
        client.responses.create(
            model=MODEL, input="weather?", tools=[WEATHER], tool_choice="required", stream=True
        )
    )
    kinds = [e.type for e in events]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    done = events[-2].item
    assert done.type == "function_call" and json.loads(done.arguments) == {"city": "Paris"}
    assert events[-1].response.output[0].call_id == done.call_id


def test_text_format_json_schema_is_a_grammar(client: openai.OpenAI, engine: FakeEngine):
    engine.script = ['{"city": "Rome"}']
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    r = client.responses.create(
        model=MODEL,
        input="a city",
        text={"format": {"type": "json_schema", "name": "city", "schema": schema, "strict": True}},
    )
    assert engine.added[-1].params.grammar
    assert json.loads(r.output_text) == {"city": "Rome"}
    assert r.text.format.type == "json_schema"


def test_retrieve_list_delete_and_tenants(base_url: str, client: openai.OpenAI) -> None:
    r = client.responses.create(model=MODEL, input="keep me", metadata={"k": "v"})
    got = client.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text and got.metadata == {"k": "v"}
    [item] = client.responses.input_items.list(r.id).data
    assert item.type == "message" and item.content[0].text == "keep me"
    other = openai.OpenAI(
        base_url=base_url + "/v1",
        api_key="k",
        max_retries=0,
        default_headers={"X-Tenant": "someone-else"},
    )
    for attempt in (
        lambda: other.responses.retrieve(r.id),
        lambda: other.responses.input_items.list(r.id),
        lambda: other.responses.delete(r.id),
        lambda: other.responses.create(model=MODEL, input="x", previous_response_id=r.id),
    ):
        with pytest.raises(openai.NotFoundError):
            attempt()
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(r.id)


def test_store_false_keeps_nothing(client: openai.OpenAI) -> None:
    r = client.responses.create(model=MODEL, input="forget me", store=False)
    assert r.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"background": True}, "background"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        ({"input": [{"type": "input_image", "image_url": "x"}]}, "input[0].type"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_file"}]}]},
            "input[0].content[0].type",
        ),
        ({"input": []}, "input"),
        ({"tool_choice": {"type": "web_search"}}, "tool_choice"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"temperature": 9}, "temperature"),
        ({"text": {"verbosity": "low"}}, "text.verbosity"),
        (
            {"text": {"format": {"type": "json_schema", "name": "n", "schema": False}}},
            "text.format.schema",
        ),
    ],
)
def test_what_is_refused_is_named(base_url: str, body: dict, param: str) -> None:
    r = httpx.post(base_url + "/v1/responses", json={"input": "hi", **body}, timeout=10)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_truncation_auto_drops_the_oldest_messages(base_url: str, engine: FakeEngine) -> None:
    """A history past the context (256 tokens here) is a 400 naming input unless truncation
    is auto, which keeps the instructions and the newest messages."""
    old = [{"role": "user", "content": f"old{i} " + "word " * 60} for i in range(4)]
    body = {"instructions": "rules", "input": [*old, {"role": "user", "content": "newest"}]}
    url = base_url + "/v1/responses"
    r = httpx.post(url, json={**body, "max_output_tokens": 8}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "input", r.text
    r = httpx.post(url, json={**body, "max_output_tokens": 8, "truncation": "auto"}, timeout=10)
    assert r.status_code == 200 and r.json()["truncation"] == "auto", r.text
    prompt = _prompt(engine)
    assert "rules" in prompt and "newest" in prompt and "old0" not in prompt
    assert len(engine.added[-1].prompt_token_ids) + 8 <= 256


def test_without_a_store(make_config, engine: FakeEngine) -> None:
    with served(make_config(responses_store="none"), engine) as port:
        url = f"http://127.0.0.1:{port}/v1/responses"
        r = httpx.post(url, json={"input": "hi", "previous_response_id": "resp_x"}, timeout=10)
        assert r.status_code == 400 and "--responses-store none" in r.json()["error"]["message"]
        kept = httpx.post(url, json={"input": "hi"}, timeout=10).json()
        assert kept["store"] is False
        assert httpx.get(f"{url}/{kept['id']}", timeout=10).status_code == 404


@pytest.fixture(scope="module")
def postgres(tmp_path_factory) -> Iterator[object]:
    """A real PostgreSQL server from the pgserver wheel (skipped only where it does not
    install), stopped with the module."""
    pgserver = pytest.importorskip("pgserver")
    pytest.importorskip("psycopg")
    server = pgserver.get_server(tmp_path_factory.mktemp("pgdata"), cleanup_mode="stop")
    yield server
    server.cleanup()


def _database(server, name: str) -> str:
    """A new, empty database of the server: its URL."""
    import psycopg

    with psycopg.connect(server.get_uri(), autocommit=True) as admin:
        admin.execute(f"CREATE DATABASE {name}")
    return server.get_uri(name)


@pytest.fixture(params=["sqlite", "postgresql"])
def target(request, tmp_path) -> str:
    if request.param == "sqlite":
        return str(tmp_path / "r.sqlite")
    return _database(request.getfixturevalue("postgres"), f"limits_{tmp_path.name[-8:].lower()}")


def test_the_store_outlives_its_process_and_keeps_its_limits(target: str, make_config) -> None:
    """A response stored by one store is read by another on the same file or database (a
    restarted or second frontend); the byte limit drops the oldest first, the age limit the
    old; another tenant finds nothing."""
    config = make_config(responses_store=target, responses_store_bytes=10_000)

    async def run() -> None:
        first = open_store(config)
        for i in range(3):
            body = {"id": f"resp_{i}", "created_at": 1e12 + i, "output": [], "pad": "x" * 3000}
            await first.put("t", body, [{"type": "message", "id": f"m{i}"}])
        first.close()
        second = open_store(config)
        kept = await second.get("resp_2", "t")
        assert kept is not None and kept.context == [{"type": "message", "id": "m2"}]
        assert await second.get("resp_2", "u") is None
        assert not await second.delete("resp_2", "u")
        await second.put("t", {"id": "resp_3", "created_at": 1e12 + 3, "pad": "x" * 3000}, [])
        assert await second.get("resp_0", "t") is None  # the oldest, past 10 kB
        assert await second.get("resp_3", "t") is not None
        await second.put("t", {"id": "resp_old", "created_at": 1.0}, [])
        assert await second.get("resp_old", "t") is None  # older than 30 days
        assert await second.delete("resp_3", "t") and await second.get("resp_3", "t") is None
        second.close()

    asyncio.run(run())


def test_a_postgresql_store_behind_the_app(postgres, make_config, engine: FakeEngine) -> None:
    """--responses-store postgresql://...: store, continue, list, another tenant's 404."""
    url = _database(postgres, "app")
    with served(make_config(responses_store=url), engine) as port:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="k", max_retries=0)
        first = client.responses.create(model=MODEL, input="red green")
        follow = client.responses.create(model=MODEL, input="blue", previous_response_id=first.id)
        items = client.responses.input_items.list(follow.id, order="asc").data
        assert [it.role for it in items] == ["user", "assistant", "user"]
        other = client.with_options(default_headers={"X-Tenant": "other"})
        with pytest.raises(openai.NotFoundError):
            other.responses.retrieve(first.id)
