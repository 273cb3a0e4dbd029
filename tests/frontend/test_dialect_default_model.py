"""The OpenAI dialect against the default model through a real server and the official client:
structured output with parse(), schemas, budgets."""

from __future__ import annotations

import json

import openai
import pydantic
import pytest

from tests.server import Server

pytestmark = pytest.mark.slow


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
