"""The OpenAI dialect against the default model through a real server and the official client:
structured output with parse(), schemas, budgets; forced tool calls: a function whose schema
says nothing of additionalProperties still gets a call that closes, pydantic's `$defs` schemas
are taken, and a call cut by max_tokens is still reported."""

from __future__ import annotations

import json

import openai
import pydantic
import pytest

from tests.server import Server

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"
WEATHER_ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {  # as people write them: no additionalProperties
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "the weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


class Address(pydantic.BaseModel):
    street: str
    city: str


class Delivery(pydantic.BaseModel):
    item: str
    to: Address


DELIVERY = {
    "type": "function",
    "function": {"name": "deliver", "parameters": Delivery.model_json_schema()},
}


class Capital(pydantic.BaseModel):
    country: str
    capital: str


@pytest.fixture(scope="module")
def client():
    s = Server("--dtype", "float32")
    yield openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=120)
    assert s.stop() == 0, s.read_log()


ASK = [{"role": "user", "content": "What is the capital of France? Answer in JSON."}]


def test_parse_with_a_pydantic_model(client):
    r = client.chat.completions.parse(
        model="SmolLM2-135M-Instruct",
        messages=ASK,
        response_format=Capital,
        temperature=0,
        max_tokens=64,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Capital)
    assert Capital.model_validate_json(choice.message.content) == choice.message.parsed


def test_json_object_is_compact_json(client):
    r = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=ASK,
        response_format={"type": "json_object"},
        temperature=0,
        max_tokens=64,
    )
    text = r.choices[0].message.content
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
        assert json.dumps(json.loads(text), separators=(",", ":"), ensure_ascii=False) == text
    else:
        assert r.choices[0].finish_reason == "length" and text.startswith("{")


def test_out_of_tokens_is_length(client):
    r = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=ASK,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "c", "schema": Capital.model_json_schema(), "strict": True},
        },
        temperature=0,
        max_tokens=3,
    )
    assert r.choices[0].finish_reason == "length"
    assert r.choices[0].message.content.startswith('{"')


class Weather(pydantic.BaseModel):
    city: str
    unit: str


WEATHER_TOOL = openai.pydantic_function_tool(Weather, name="get_weather")
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_forced_tool_calls_follow_the_schema(client, choice, stream):
    args = dict(
        model="SmolLM2-135M-Instruct",
        messages=ASK_WEATHER,
        tools=[WEATHER_TOOL],
        tool_choice=choice,
        # why one call: with several allowed this small model keeps calling until the budget
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=96,
    )
    if stream:
        with client.chat.completions.stream(**args) as s:
            r = s.get_final_completion()
    else:
        r = client.chat.completions.create(**args)
    choice_out = r.choices[0]
    assert choice_out.finish_reason == "tool_calls"
    calls = choice_out.message.tool_calls
    assert calls and all(c.function.name == "get_weather" for c in calls)
    for call in calls:
        Weather.model_validate_json(call.function.arguments)


def test_tool_result_round_trip_answers(client):
    first = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=ASK_WEATHER,
        tools=[WEATHER_TOOL],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=96,
    )
    (call,) = first.choices[0].message.tool_calls
    history = [
        *ASK_WEATHER,
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"},
    ]
    r = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=history,
        tools=[WEATHER_TOOL],
        temperature=0,
        max_tokens=32,
    )
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert r.usage.prompt_tokens > first.usage.prompt_tokens


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_forced_call_closes(client, stream) -> None:
    args = dict(
        model=MODEL,
        messages=WEATHER_ASK,
        tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=0,
        max_tokens=64,
    )
    if stream:
        with client.chat.completions.stream(**args) as s:
            r = s.get_final_completion()
    else:
        r = client.chat.completions.create(**args)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    assert set(arguments) == {"city"} and isinstance(arguments["city"], str)


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "deliver"}}]
)
def test_pydantic_parameters_with_refs(client, choice) -> None:
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Send a book to 1 Main St, Paris."}],
        tools=[WEATHER, DELIVERY] if choice == "required" else [DELIVERY],
        tool_choice=choice,
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=96,
    )
    out = r.choices[0]
    assert out.finish_reason == "tool_calls", out
    (call,) = out.message.tool_calls
    if call.function.name == "deliver":
        Delivery.model_validate_json(call.function.arguments)
    else:
        assert set(json.loads(call.function.arguments)) == {"city"}


def test_a_call_cut_by_max_tokens_is_reported(client) -> None:
    args = dict(
        model=MODEL,
        messages=WEATHER_ASK,
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
    )
    whole = client.chat.completions.create(**args, max_tokens=64)
    (call,) = whole.choices[0].message.tool_calls
    written = json.dumps(json.loads(call.function.arguments), separators=(",", ":"))
    r = client.chat.completions.create(**args, max_tokens=whole.usage.completion_tokens - 8)
    out = r.choices[0]
    assert out.finish_reason == "length"
    (cut,) = out.message.tool_calls
    assert cut.function.name == "get_weather"
    got = cut.function.arguments
    if got != call.function.arguments:  # cut inside the arguments: as far as they came
        assert got and written.startswith(got), (written, got)
