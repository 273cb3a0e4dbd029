"""response_format reaches the engine as a checked grammar; a schema that cannot be used is a
400 naming it."""

from __future__ import annotations

import httpx
import llguidance
import pytest

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
    from gapless.core.common.grammars import make_tokenizer

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
