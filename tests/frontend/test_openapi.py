"""/openapi.json states the ranges the server checks, and auth only when it has a key."""

from __future__ import annotations

import httpx
import pytest

from tests.frontend.conftest import MAX_MODEL_LEN, build_app

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
        "type": "integer", "minimum": 1, "maximum": MAX_MODEL_LEN,
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
    chat = doc["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert chat["messages"]["minItems"] == 1
    assert _option(chat["top_logprobs"], "integer")["maximum"] == 5


async def test_auth_is_declared_only_with_a_key(make_config, engine) -> None:
    open_doc = await _doc(make_config(), engine)
    assert "security" not in open_doc and "securitySchemes" not in open_doc["components"]
    keyed = await _doc(make_config(api_key="sekrit"), engine)
    assert keyed["security"] == [{"bearer": []}]
    assert keyed["paths"]["/health"]["get"]["security"] == []
    assert keyed["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
