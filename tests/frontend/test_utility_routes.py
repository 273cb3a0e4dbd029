"""/tokenize, /detokenize, /version, /v1/models/{id}; every route in /openapi.json and behind
the API key."""

from __future__ import annotations

import httpx
import pytest

from tests.frontend.conftest import MAX_MODEL_LEN, MODEL, build_app

pytestmark = pytest.mark.anyio


async def test_tokenize_prompt_and_messages(client: httpx.AsyncClient, engine) -> None:
    r = await client.post("/tokenize", json={"model": MODEL, "prompt": "hello there"})
    ids = engine.tokenizer.encode("hello there", add_special_tokens=False).ids
    assert r.json() == {"tokens": ids, "count": len(ids), "max_model_len": MAX_MODEL_LEN}
    messages = [{"role": "user", "content": "hi"}]
    r = await client.post("/tokenize", json={"messages": messages})
    chat = await client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1})
    assert chat.status_code == 200
    assert r.json()["tokens"] == engine.added[0].prompt_token_ids
    r = await client.post("/tokenize", json={"messages": messages, "add_generation_prompt": False})
    assert r.json()["count"] < len(engine.added[0].prompt_token_ids)


async def test_detokenize(client: httpx.AsyncClient, engine) -> None:
    ids = engine.tokenizer.encode("hello there", add_special_tokens=False).ids
    r = await client.post("/detokenize", json={"model": MODEL, "tokens": ids})
    assert r.json() == {"prompt": "hello there"}
    r = await client.post("/detokenize", json={"tokens": [10**9]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "prompt"),
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/detokenize", {}, "tokens"),
    ],
)
async def test_bad_bodies(client: httpx.AsyncClient, path, body, param) -> None:
    r = await client.post(path, json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param


async def test_version_and_model_card(client: httpx.AsyncClient) -> None:
    assert (await client.get("/version")).json()["version"]
    r = await client.get(f"/v1/models/{MODEL}")
    assert r.status_code == 200 and r.json()["id"] == MODEL
    r = await client.get("/v1/models/other")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


async def test_every_route_is_documented_and_needs_the_key(make_config, engine) -> None:
    app = build_app(make_config(api_key="k"), engine)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
        paths = set(
            (await c.get("/openapi.json", headers={"authorization": "Bearer k"})).json()["paths"]
        )
        stored = {"/v1/responses/{response_id}", "/v1/responses/{response_id}/input_items"}
        routes = set(app.routes) | {"/v1/models/{model}"} | stored
        assert routes == paths
        for path in ("/v1/responses/resp_x", "/v1/responses/resp_x/input_items"):
            assert (await c.get(path)).status_code == 401
        for path in ("/tokenize", "/detokenize"):
            assert (await c.post(path, json={})).status_code == 401
        for path in ("/version", f"/v1/models/{MODEL}", "/openapi.json"):
            assert (await c.get(path)).status_code == 401
        assert (await c.get("/health")).status_code == 200
