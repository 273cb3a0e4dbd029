"""Every OpenAI request field is honoured, harmless, or refused by name; batched prompts, echo."""

from __future__ import annotations

import logging

import httpx
import pytest
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params
from openai.types.responses import response_create_params

from gapless.frontend.api.openai_fields import (
    CHAT_REFUSED,
    COMPLETION_REFUSED,
    HARMLESS,
    RESPONSES_REFUSED,
    struct_fields,
)
from gapless.frontend.api.protocol import ChatCompletionRequest, CompletionRequest
from gapless.frontend.api.responses_protocol import ResponsesRequest
from tests.frontend.conftest import sse_events

pytestmark = pytest.mark.anyio
USER = [{"role": "user", "content": "one two three"}]


@pytest.mark.parametrize(
    ("openai_type", "schema", "refused"),
    [
        (chat_create_params.CompletionCreateParamsBase, ChatCompletionRequest, CHAT_REFUSED),
        (
            completion_create_params.CompletionCreateParamsBase,
            CompletionRequest,
            COMPLETION_REFUSED,
        ),
        (response_create_params.ResponseCreateParamsBase, ResponsesRequest, RESPONSES_REFUSED),
    ],
)
def test_every_field_of_the_pinned_openai_types_has_a_rule(openai_type, schema, refused) -> None:
    fields = set(openai_type.__annotations__)
    handled = struct_fields(schema) | HARMLESS | refused.keys()
    assert fields - handled == set()


async def test_harmless_fields_are_accepted(client: httpx.AsyncClient) -> None:
    harmless = {
        "store": True,
        "metadata": {"a": "b"},
        "service_tier": "auto",
        "prompt_cache_key": "k",
        "safety_identifier": "s",
        "n": 1,
        "modalities": ["text"],
        "audio": None,
        "reasoning_effort": None,
    }
    r = await client.post("/v1/chat/completions", json={"messages": USER, **harmless})
    assert r.status_code == 200, r.text
    r = await client.post("/v1/completions", json={"prompt": "hi", "best_of": 1, "suffix": ""})
    assert r.status_code == 200, r.text


async def test_unknown_fields_are_logged_at_debug(client: httpx.AsyncClient, caplog) -> None:
    with caplog.at_level(logging.DEBUG, logger="gapless.frontend"):
        r = await client.post("/v1/completions", json={"prompt": "hi", "frobnicate": 3})
    assert r.status_code == 200
    assert any("frobnicate" in rec.getMessage() for rec in caplog.records)


async def test_developer_role_renders_as_system(client: httpx.AsyncClient, engine) -> None:
    system = [{"role": "system", "content": "be brief"}, *USER]
    developer = [{"role": "developer", "content": "be brief"}, *USER]
    for messages in (system, developer):
        r = await client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1})
        assert r.status_code == 200, r.text
    assert engine.added[0].prompt_token_ids == engine.added[1].prompt_token_ids


async def test_sampling_extras_reach_the_engine(client: httpx.AsyncClient, engine) -> None:
    body = {
        "prompt": "hi",
        "logit_bias": {"7": 100, "3": -5.5},
        "min_tokens": 2,
        "allowed_token_ids": [9, 7, 3],
        "bad_words": ["blue sky"],
    }
    r = await client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    params = engine.added[0].params
    assert params.logit_bias == ((3, -5.5), (7, 100.0))
    assert params.min_tokens == 2 and params.allowed_token_ids == (3, 7, 9)
    encode = engine.tokenizer.encode
    expected = {tuple(encode(w, add_special_tokens=False).ids) for w in ("blue sky", " blue sky")}
    assert set(params.bad_words_ids) == expected


async def test_batched_prompts_give_n_choices_each(client: httpx.AsyncClient, engine) -> None:
    encode = engine.tokenizer.encode
    for prompt in (["red green", "one two"], [encode(p).ids for p in ("red green", "one two")]):
        engine.added.clear()
        r = await client.post("/v1/completions", json={"prompt": prompt, "n": 2, "max_tokens": 1})
        assert r.status_code == 200, r.text
        body = r.json()
        assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
        assert [c["text"] for c in body["choices"]] == ["red", "red", "one", "one"]
        red, one = (len(encode(p).ids) for p in ("red green", "one two"))
        assert body["usage"]["prompt_tokens"] == red + one
        assert [len(a.prompt_token_ids) for a in engine.added] == [red, red, one, one]


async def test_echo_prepends_the_prompt(client: httpx.AsyncClient, engine) -> None:
    ids = engine.tokenizer.encode("one two").ids
    for prompt, text in (("one two", "one two"), (ids, "one two")):
        r = await client.post(
            "/v1/completions", json={"prompt": prompt, "echo": True, "max_tokens": 1}
        )
        assert r.json()["choices"][0]["text"] == text + "one"
    r = await client.post(
        "/v1/completions",
        json={"prompt": ["one two", "three"], "echo": True, "max_tokens": 1, "stream": True},
    )
    texts: dict[int, str] = {}
    for chunk in sse_events(r.text)[:-1]:
        for choice in chunk["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    assert texts == {0: "one twoone", 1: "threethree"}


async def test_completions_default_to_16_tokens(client: httpx.AsyncClient, engine) -> None:
    r = await client.post("/v1/completions", json={"prompt": "hi"})
    assert r.status_code == 200
    assert engine.added[0].params.max_tokens == 16


async def test_echo_with_logprobs_scores_the_prompt(client: httpx.AsyncClient, engine) -> None:
    ids = engine.tokenizer.encode("one two three").ids
    body = {"prompt": "one two three", "echo": True, "logprobs": 1, "max_tokens": 1}
    r = await client.post("/v1/completions", json=body)
    assert engine.added[0].params.prompt_logprobs == 1
    lp = r.json()["choices"][0]["logprobs"]
    n = len(ids)
    assert lp["tokens"][:n] == [engine.tokenizer.decode([t]) for t in ids]
    assert lp["token_logprobs"] == [None] + [-0.25] * (n - 1) + [-0.5]
    assert lp["top_logprobs"][0] is None and len(lp["top_logprobs"]) == n + 1
    assert lp["text_offset"][n] == len("one two three")
    r = await client.post("/v1/completions", json={**body, "stream": True})
    first = sse_events(r.text)[0]["choices"][0]
    assert first["text"] == "one two three"
    assert first["logprobs"]["token_logprobs"] == [None] + [-0.25] * (n - 1)
    engine.added.clear()
    await client.post("/v1/completions", json={**body, "echo": False})
    assert engine.added[0].params.prompt_logprobs is None
