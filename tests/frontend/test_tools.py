"""Tools: tool_choice plans, the Hermes parser (whole and streamed), the fallback prompt, and
answers shaped as tool_calls."""

from __future__ import annotations

import json
import sys

import httpx
import llguidance
import pytest

from gapless.common.grammars import make_tokenizer
from gapless.frontend.api.tool_parsers import HermesParser
from gapless.frontend.http.json_depth import MAX_JSON_DEPTH
from tests.frontend.conftest import build_app, sse_events

pytestmark = pytest.mark.anyio
USER = [{"role": "user", "content": "Weather in Paris?"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "the weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
CALL = '<tool_call>{"name":"get_weather","arguments":{"city":"Paris"}}</tool_call>'


def accepts(grammar: str, text: str, tokenizer) -> bool:
    view = make_tokenizer(tokenizer.to_str(), 49152, (2,))
    matcher = llguidance.LLMatcher(view, grammar)
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    return all(matcher.consume_token(t) for t in ids) and matcher.consume_token(2)


def test_hermes_parse_whole() -> None:
    parsed = HermesParser().parse(f"Let me check.\n{CALL}\n{CALL.replace('Paris', 'Rome')}")
    assert parsed.content.strip() == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_weather", {"city": "Rome"}),
    ]
    assert len({c.id for c in parsed.calls}) == 2
    broken = "<tool_call>{not json}</tool_call>"
    assert HermesParser().parse(broken).content == broken  # nothing the model wrote is lost


def test_hermes_call_nested_past_the_bound_stays_content() -> None:
    """The model's output is parsed under the same nesting bound as a request, whatever the
    recursion limit: a call nested past it stays content, at the bound it is a call."""
    before = sys.getrecursionlimit()
    sys.setrecursionlimit(100_000)
    try:
        for depth, is_call in [(MAX_JSON_DEPTH, True), (MAX_JSON_DEPTH + 1, False), (10**6, False)]:
            args = '{"a":' * (depth - 1) + "{}" + "}" * (depth - 1)  # an object `depth` deep
            # written as an object, the call's own object is one more level
            for written, depth_written in ((args, depth + 1), (json.dumps(args), depth)):
                text = f'<tool_call>{{"name":"f","arguments":{written}}}</tool_call>'
                parsed = HermesParser().parse(text)
                is_call = depth_written <= MAX_JSON_DEPTH
                assert (len(parsed.calls), parsed.content == text) == (int(is_call), not is_call)
    finally:
        sys.setrecursionlimit(before)


@pytest.mark.parametrize("size", [1, 3, 7, 1000])
def test_hermes_stream_in_pieces_equals_whole(size: int) -> None:
    text = f"Sure. {CALL} done <tool"
    reader = HermesParser().reader()
    content, calls = "", []
    for i in range(0, len(text), size):
        got = reader.feed(text[i : i + size])
        assert "<tool_call" not in got.content  # a tag is never sent as content
        content += got.content
        calls += got.calls
    rest = reader.finish()
    assert content + rest.content == "Sure.  done <tool"
    assert [c.name for c in calls + rest.calls] == ["get_weather"]


async def test_required_and_named_are_grammars(client: httpx.AsyncClient, engine) -> None:
    tok = engine.tokenizer
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        r = await client.post(
            "/v1/chat/completions",
            json={"messages": USER, "tools": [WEATHER, TIME], "tool_choice": choice},
        )
        assert r.status_code == 200, r.text
    required, named = (a.params.grammar for a in engine.added)
    assert accepts(required, CALL, tok) and accepts(named, CALL, tok)
    time_call = '<tool_call>{"name":"get_time","arguments":{}}</tool_call>'
    assert accepts(required, f"{CALL}\n{time_call}", tok)
    assert not accepts(named, time_call, tok)
    assert not accepts(
        required, '<tool_call>{"name":"get_weather","arguments":{}}</tool_call>', tok
    )
    assert not accepts(required, "Paris is sunny.", tok)


async def test_parallel_tool_calls_false_allows_one_call(client: httpx.AsyncClient, engine):
    body = {"messages": USER, "tools": [WEATHER], "tool_choice": "required"}
    await client.post("/v1/chat/completions", json={**body, "parallel_tool_calls": False})
    grammar = engine.added[0].params.grammar
    assert accepts(grammar, CALL, engine.tokenizer)
    assert not accepts(grammar, f"{CALL}\n{CALL}", engine.tokenizer)


async def test_auto_and_none(client: httpx.AsyncClient, engine) -> None:
    for choice in ("auto", "none"):
        r = await client.post(
            "/v1/chat/completions",
            json={"messages": USER, "tools": [WEATHER], "tool_choice": choice},
        )
        assert r.status_code == 200
    auto, none = engine.added
    assert auto.params.grammar is None and none.params.grammar is None
    prompt = engine.tokenizer.decode(auto.prompt_token_ids)
    assert "get_weather" in prompt and "<tool_call>" in prompt  # the fallback prompt
    assert "get_weather" not in engine.tokenizer.decode(none.prompt_token_ids)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
         "tool_choice.function.name"),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "f",
          "parameters": {"type": "object", "properties": {"a": {"type": "string",
                                                                  "pattern": "(("}}}}}],
          "tool_choice": "required"}, "tools"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ],
)  # fmt: skip
async def test_bad_tools_are_400(client: httpx.AsyncClient, engine, body, param) -> None:
    r = await client.post("/v1/chat/completions", json={"messages": USER, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert engine.added == []


async def test_answer_with_calls_is_tool_calls(client: httpx.AsyncClient, engine) -> None:
    engine.script = [
        "Checking. <tool",
        '_call>{"name":"get_weather",',
        '"arguments":{"city":"Paris"}}',
        "</tool_call>",
    ]
    body = {"messages": USER, "tools": [WEATHER]}
    r = await client.post("/v1/chat/completions", json=body)
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Checking. "
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    r = await client.post("/v1/chat/completions", json={**body, "stream": True})
    chunks = [c for c in sse_events(r.text)[:-1]]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("content") or "" for d in deltas) == "Checking. "
    calls = [tc for d in deltas for tc in d.get("tool_calls", [])]
    assert len(calls) == 1 and calls[0]["index"] == 0 and calls[0]["id"].startswith("call_")
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


async def test_plain_answer_keeps_stop(client: httpx.AsyncClient, engine) -> None:
    engine.script = ["It is ", "sunny."]
    r = await client.post("/v1/chat/completions", json={"messages": USER, "tools": [WEATHER]})
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["message"]["content"] == "It is sunny."
    assert "tool_calls" not in choice["message"]


async def test_tool_round_trip_renders(client: httpx.AsyncClient, engine) -> None:
    history = [
        *USER,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C and sunny"},
    ]
    r = await client.post("/v1/chat/completions", json={"messages": history, "tools": [WEATHER]})
    assert r.status_code == 200, r.text
    prompt = engine.tokenizer.decode(engine.added[0].prompt_token_ids)
    assert (
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in prompt
    )
    assert "<tool_response>\n18 C and sunny\n</tool_response>" in prompt


def _person_tool() -> dict:
    """A function whose parameters pydantic wrote: `$defs` and `$ref "#/$defs/..."`."""
    from pydantic import BaseModel

    class Address(BaseModel):
        street: str
        city: str

    class Person(BaseModel):
        name: str
        home: Address
        work: Address | None = None

    params = Person.model_json_schema()
    assert "$defs" in params and params["properties"]["home"] == {"$ref": "#/$defs/Address"}
    return {"type": "function", "function": {"name": "save_person", "parameters": params}}


@pytest.fixture
async def wide_client(make_config, engine):
    """A client of an app whose context holds a pydantic schema in the fallback prompt."""
    app = build_app(make_config(model_overrides={"max_model_len": 4096}), engine)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
        yield c
    app.state.prompter.grammars.close()


@pytest.mark.parametrize("choice", ["required", "named"])
async def test_forced_calls_resolve_refs_against_the_functions_parameters(
    wide_client: httpx.AsyncClient, engine, choice
) -> None:
    person = _person_tool()
    tool_choice = (
        {"type": "function", "function": {"name": "save_person"}} if choice == "named" else choice
    )
    r = await wide_client.post(
        "/v1/chat/completions",
        json={"messages": USER, "tools": [WEATHER, person], "tool_choice": tool_choice},
    )
    assert r.status_code == 200, r.text
    grammar = engine.added[0].params.grammar
    args = '{"name":"Ada","home":{"street":"1 Main St","city":"Paris"}}'
    call = f'<tool_call>{{"name":"save_person","arguments":{args}}}</tool_call>'
    assert accepts(grammar, call, engine.tokenizer)
    with_work = args[:-1] + ',"work":{"street":"2 Side St","city":"Rome"}}'
    assert accepts(grammar, call.replace(args, with_work), engine.tokenizer)
    assert not accepts(grammar, call.replace('"city":"Paris"', '"town":"Paris"'), engine.tokenizer)
    assert accepts(grammar, CALL, engine.tokenizer) == (choice == "required")


async def test_forced_calls_take_no_undeclared_properties(client: httpx.AsyncClient, engine):
    weather = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {  # says nothing of additionalProperties
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "where": {"type": "object", "properties": {"lat": {"type": "number"}}},
                    "extra": {"type": "object", "additionalProperties": True},
                },
                "required": ["city"],
            },
        },
    }
    r = await client.post(
        "/v1/chat/completions",
        json={"messages": USER, "tools": [weather, TIME], "tool_choice": "required"},
    )
    assert r.status_code == 200, r.text
    grammar, tok = engine.added[0].params.grammar, engine.tokenizer

    def call(name: str, args: str) -> str:
        return f'<tool_call>{{"name":"{name}","arguments":{args}}}</tool_call>'

    assert accepts(grammar, call("get_weather", '{"city":"Paris"}'), tok)
    assert not accepts(grammar, call("get_weather", '{"city":"Paris","country":"FR"}'), tok)
    assert accepts(grammar, call("get_weather", '{"city":"Paris","where":{"lat":1.5}}'), tok)
    assert not accepts(grammar, call("get_weather", '{"city":"P","where":{"lat":1,"x":2}}'), tok)
    assert accepts(grammar, call("get_weather", '{"city":"P","extra":{"any":[1]}}'), tok)
    assert accepts(grammar, call("get_time", "{}"), tok)
    assert not accepts(grammar, call("get_time", '{"zone":"UTC"}'), tok)
    # the template still sees the parameters as written
    prompt = engine.tokenizer.decode(engine.added[0].prompt_token_ids)
    assert '"additionalProperties": false' not in prompt


async def test_strict_function_refuses_what_the_engine_would_ignore(client, engine) -> None:
    tool = json.loads(json.dumps(WEATHER))
    tool["function"]["strict"] = True
    tool["function"]["parameters"]["properties"]["city"]["x-foo"] = 1
    body = {"messages": USER, "tools": [tool], "tool_choice": "required"}
    r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "tools"
    assert "'x-foo' at #/properties/city" in error["message"]
    assert "get_weather" in error["message"]
    del tool["function"]["strict"]
    r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    ("text", "name", "arguments", "content"),
    [
        ('<tool_call>{"name":"get_weather","arguments":{"city":"Pa', "get_weather",
         '{"city":"Pa', ""),
        ('<tool_call>{"name":"get_weather",', "get_weather", "", ""),
        ('Sure. <tool_call>{"name": "get_weather", "arguments": {', "get_weather", "{",
         "Sure. "),
        ('<tool_call>{"name":"get_wea', None, None, '<tool_call>{"name":"get_wea'),
        ('<tool_call>{"name":"get_weather","arguments":{"city":"Paris"}}</tool', "get_weather",
         '{"city": "Paris"}', ""),
    ],
)  # fmt: skip
def test_a_call_cut_by_max_tokens_is_still_reported(text, name, arguments, content) -> None:
    from gapless.common.messages import TextDelta
    from gapless.frontend.api.chat import ChatChunks, _message

    message, reason = _message(text, "length", HermesParser())
    assert reason == "length"
    if name is None:
        assert message.tool_calls is None and message.content == content
    else:
        (call,) = message.tool_calls
        assert (call.function.name, call.function.arguments) == (name, arguments)
        assert (message.content or "") == content
    not_cut = HermesParser().parse(text)  # ended otherwise: a broken block stays content
    if text.endswith("</tool"):  # whole JSON, stopped in the closing tag: a call either way
        assert [c.name for c in not_cut.calls] == [name]
    else:
        assert not_cut.calls == [] and not_cut.content == text
    chunks = ChatChunks("id", 0, "m", False, HermesParser())
    events = []
    for i in range(0, len(text), 7):
        last = i + 7 >= len(text)
        delta = TextDelta("r", text[i : i + 7], [1], 1, i + 1, "length" if last else None)
        if (chunk := chunks.delta(0, delta)) is not None:
            events.append(json.loads(chunk))
    final = events[-1]["choices"][0]
    assert final["finish_reason"] == "length"
    calls = [c for e in events for c in e["choices"][0]["delta"].get("tool_calls") or []]
    if name is None:
        assert calls == []
    else:
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
            (name, arguments)
        ]
