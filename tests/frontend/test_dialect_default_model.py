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
