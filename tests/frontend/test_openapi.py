"""/openapi.json states the ranges the server checks, and auth only when it has a key; what it
allows the server accepts and what it forbids the server refuses (tests/frontend/
test_schema_fuzz.py fuzzes the whole of it); streamed events have a schema of their own."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema_rs
import pytest

from gapless.common.sampling_ranges import FLOAT_RANGES, LOGIT_BIAS, sampling_ranges
from gapless.frontend.api.openapi import below
from tests.frontend.conftest import MAX_MODEL_LEN, build_app, sse_events
from tests.frontend.schema_hooks import beyond_the_schema

pytestmark = pytest.mark.anyio


async def _doc(config, engine) -> dict:
    transport = httpx.ASGITransport(app=build_app(config, engine))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        headers = {"Authorization": "Bearer sekrit"}
        return (await client.get("/openapi.json", headers=headers)).json()


def _option(prop: dict, json_type: str) -> dict:
    return next(o for o in prop.get("anyOf", [prop]) if o.get("type") == json_type)


async def test_value_ranges_follow_the_config(make_config, engine) -> None:
    doc = await _doc(make_config(max_n=3), engine)
    props = doc["components"]["schemas"]["CompletionRequest"]["properties"]
    assert _option(props["max_tokens"], "integer") == {
        "type": "integer", "minimum": 1, "maximum": MAX_MODEL_LEN - 1,
    }  # fmt: skip
    assert _option(props["n"], "integer")["maximum"] == 3
    assert _option(props["temperature"], "number") == {
        "type": "number", "minimum": 0, "maximum": 2,
    }  # fmt: skip
    assert _option(props["top_p"], "number")["exclusiveMinimum"] == 0
    stop = _option(props["stop"], "array")
    assert stop["maxItems"] == 16 and stop["items"]["minLength"] == 1
    assert _option(props["stop_token_ids"], "array")["items"]["maximum"] == 49151
    assert _option(props["prompt"], "string")["minLength"] == 1
    text, ids, batch = props["prompt"]["anyOf"]
    assert ids["minItems"] == 1 and ids["items"]["maximum"] == 49151
    assert batch["items"]["anyOf"] == [text, ids] and batch["minItems"] == 1
    chat = doc["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert chat["messages"]["minItems"] == 1
    assert _option(chat["top_logprobs"], "integer")["maximum"] == 5


async def test_the_documents_ranges_are_the_tables(make_config, engine) -> None:
    """Each sampling field's range in the document is common/sampling_ranges.py's, in both
    generation routes; the output budget is one short of the context (a prompt takes a
    token)."""
    config = make_config(max_n=3)
    doc = await _doc(config, engine)
    compared = 0
    for route in ("CompletionRequest", "ChatCompletionRequest"):
        props = doc["components"]["schemas"][route]["properties"]
        for name, allowed in sampling_ranges(config).items():
            if name not in props or (route, name) == ("ChatCompletionRequest", "logprobs"):
                continue  # a field the route lacks; chat's logprobs is a flag
            option = _option(props[name], "number" if name in FLOAT_RANGES else "integer")
            want = allowed.json_schema()
            if name in ("max_tokens", "max_completion_tokens"):
                want["maximum"] -= 1
            keys = ("minimum", "exclusiveMinimum", "maximum")
            assert {k: option[k] for k in keys if k in option} == want, (route, name)
            compared += 1
        bias = _option(props["logit_bias"], "object")["additionalProperties"]
        assert {k: bias[k] for k in ("minimum", "maximum")} == LOGIT_BIAS.json_schema()
    assert compared >= 25, compared


async def test_auth_is_declared_only_with_a_key(make_config, engine) -> None:
    open_doc = await _doc(make_config(), engine)
    assert "security" not in open_doc and "securitySchemes" not in open_doc["components"]
    keyed = await _doc(make_config(api_key="sekrit"), engine)
    assert keyed["security"] == [{"bearer": []}]
    assert keyed["paths"]["/health"]["get"]["security"] == []
    assert keyed["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"


def _validator(doc: dict, name: str) -> jsonschema_rs.Validator:
    root = {"$ref": f"#/components/schemas/{name}", "components": doc["components"]}
    return jsonschema_rs.Draft202012Validator(root)


# (route, body, schema): each body's validity by the document must be the server's verdict
AGREE = [
    ("/v1/completions", {"prompt": [[]]}, "CompletionRequest"),  # was allowed, refused
    ("/v1/completions", {"prompt": ["hi", []]}, "CompletionRequest"),
    ("/v1/completions", {"prompt": [1, "hi"]}, "CompletionRequest"),
    ("/v1/completions", {"prompt": [[5, 6], "hi"]}, "CompletionRequest"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2.0}, "CompletionRequest"),  # was refused
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2.5}, "CompletionRequest"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"49151": 1}}, "CompletionRequest"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"49152": 1}}, "CompletionRequest"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"\u00b2": 1}}, "CompletionRequest"),
    ("/v1/completions", {"prompt": "hi", "allowed_token_ids": []}, "CompletionRequest"),
    ("/v1/completions", {"prompt": "hi", "bad_words": ["\x1c"]}, "CompletionRequest"),
    ("/v1/completions", {"prompt": "hi", "cache_salt": ""}, "CompletionRequest"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"text": "hi"}]}]},
     "ChatCompletionRequest"),  # a part without type: was forbidden, accepted
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
     "ChatCompletionRequest"),  # top_logprobs without logprobs: was allowed, refused
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True,
     "top_logprobs": 2}, "ChatCompletionRequest"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
     "tool_choice": "required"}, "ChatCompletionRequest"),
    ("/v1/chat/completions", {"messages": [{"role": "assistant", "content": "hi"}],
     "continue_final_message": True}, "ChatCompletionRequest"),
    ("/tokenize", {}, "TokenizeRequest"),  # neither prompt nor messages: was allowed, refused
    ("/tokenize", {"prompt": None, "messages": None}, "TokenizeRequest"),
    ("/tokenize", {"prompt": "hi", "messages": [{"role": "user", "content": "hi"}]},
     "TokenizeRequest"),
    ("/tokenize", {"prompt": "hi", "messages": None}, "TokenizeRequest"),
    ("/tokenize", {"prompt": ""}, "TokenizeRequest"),
    ("/detokenize", {"tokens": [5, 6], "extra": {"ignored": True}}, "DetokenizeRequest"),
    ("/detokenize", {"tokens": [-267]}, "DetokenizeRequest"),  # was allowed, refused
    ("/detokenize", {"tokens": [5.0]}, "DetokenizeRequest"),  # was refused, allowed
]  # fmt: skip


@pytest.mark.parametrize("route, body, schema", AGREE, ids=[json.dumps(c[1]) for c in AGREE])
async def test_the_document_and_the_server_agree(make_config, engine, route, body, schema) -> None:
    config = make_config()
    doc = await _doc(config, engine)
    allowed = _validator(doc, schema).is_valid(body)
    transport = httpx.ASGITransport(app=build_app(config, engine))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        r = await client.post(route, json=body)
    accepted = r.status_code == 200
    if not accepted:
        assert r.status_code == 400 and not beyond_the_schema(r.status_code, r.content), r.text
    assert allowed == accepted, (allowed, r.status_code, r.text)


async def test_the_model_route_declares_its_path_parameter(make_config, engine) -> None:
    doc = await _doc(make_config(), engine)
    (param,) = doc["paths"]["/v1/models/{model}"]["get"]["parameters"]
    assert param["name"] == "model" and param["in"] == "path" and param["required"] is True
    last, replica = doc["paths"]["/v1/engine/timeline"]["get"]["parameters"]
    assert last["in"] == "query" and last["schema"]["maximum"] == 8192
    assert replica["name"] == "replica" and replica["schema"]["maximum"] == 0  # one replica
    assert doc["paths"]["/v1/engine/stats"]["get"]["parameters"] == [replica]


@pytest.mark.parametrize(
    "route, body, chunk",
    [
        ("/v1/completions", {"prompt": "one two three", "stream": True}, "CompletionChunk"),
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "one two"}],
                "stream": True,
                "n": 2,
                "stream_options": {"include_usage": True},
            },
            "ChatCompletionChunk",
        ),
    ],  # fmt: skip
)
async def test_streamed_events_have_their_own_schema(make_config, engine, route, body, chunk):
    doc = await _doc(make_config(), engine)
    stream = doc["paths"][route]["post"]["responses"]["200"]["content"]["text/event-stream"]
    data = stream["schema"]["properties"]["data"]
    assert data["if"] == {"const": "[DONE]"}
    content = data["else"]["contentSchema"]["anyOf"]
    assert content == [{"$ref": f"#/components/schemas/{chunk}"},
                       {"$ref": "#/components/schemas/ErrorResponse"}]  # fmt: skip
    events_schema = jsonschema_rs.Draft202012Validator(
        {"type": "object", "required": ["data"], "properties": {"data": {"type": "string"}}}
    )
    payload = _validator(doc, chunk)
    transport = httpx.ASGITransport(app=build_app(make_config(), engine))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        r = await client.post(route, json=body)
    events = sse_events(r.text)
    assert events[-1] == "[DONE]" and len(events) > 2
    for event in events[:-1]:
        events_schema.validate({"data": json.dumps(event)})
        payload.validate(event)  # each chunk is its chunk schema's, not the whole answer's


@pytest.mark.parametrize("n", [1, 2, 9, 10, 11, 100, 49152, 50000, 99999, 100001])
def test_below_matches_exactly_the_numbers_under_n(n) -> None:
    pattern = re.compile(below(n))
    for k in [*range(min(n + 12, 2000)), n - 1, n, n + 1, 10 * n]:
        assert bool(pattern.fullmatch(str(k))) == (k < n), (n, k)


@pytest.mark.parametrize(
    "status, error, beyond",
    [
        (400, {"param": "prompt", "code": "context_length_exceeded", "message": "x"}, True),
        (
            400,
            {"param": "min_tokens", "message": "min_tokens (9) must not exceed max_tokens"},
            True,
        ),
        (400, {"param": "tools", "message": "tools hold two functions with the same name"}, True),
        (400, {"param": "prompt", "message": "prompt must not be empty"}, False),
        (400, {"param": "min_tokens", "message": "min_tokens must not be negative"}, False),
        (422, {"code": "context_length_exceeded", "message": "x"}, False),
    ],
)
def test_only_named_rules_pass_as_beyond_the_schema(status, error, beyond) -> None:
    assert beyond_the_schema(status, json.dumps({"error": error}).encode()) is beyond


async def test_links_name_operations_that_exist(make_config, engine) -> None:
    doc = await _doc(make_config(), engine)
    operations = {
        op["operationId"]: op for methods in doc["paths"].values() for op in methods.values()
    }
    assert len(operations) == sum(len(methods) for methods in doc["paths"].values())
    links = [
        link
        for op in operations.values()
        for response in op["responses"].values()
        for link in response.get("links", {}).values()
    ]
    assert {link["operationId"] for link in links} == {"retrieveModel", "detokenize"}
