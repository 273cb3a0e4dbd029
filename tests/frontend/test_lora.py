"""LoRA adapters at the frontend: a request names one in `model`; /v1/models lists the ones
the caller may name, each with its parent and never its path; with a keys file a tenant sees
only its own adapters (another's is a 404, as a model that does not exist); the adapter is
part of the prefix-cache names the frontend computes."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest

from gapless.common.config import TenantSpec
from tests.frontend.conftest import build_app

pytestmark = pytest.mark.anyio

ADAPTERS = {"acme-sql": "/srv/lora/acme-sql", "beta-fr": "/srv/lora/beta-fr", "both": "/srv/b"}
KEYS = {"sk-acme": "acme", "sk-beta": "beta"}
TENANTS = {"acme": TenantSpec(lora_adapters=("acme-sql", "both")),
           "beta": TenantSpec(lora_adapters=("beta-fr", "both"))}  # fmt: skip
ACME = {"authorization": "Bearer sk-acme"}
BETA = {"authorization": "Bearer sk-beta"}


async def _client(config, engine) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=build_app(config, engine))
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
        yield c


@pytest.fixture
async def keyed(make_config, engine) -> AsyncIterator[httpx.AsyncClient]:
    config = make_config(api_keys=KEYS, tenants=TENANTS, lora_modules=ADAPTERS, enable_lora=True)
    async for c in _client(config, engine):
        yield c


@pytest.fixture
async def open_(make_config, engine) -> AsyncIterator[httpx.AsyncClient]:
    async for c in _client(make_config(lora_modules=ADAPTERS, enable_lora=True), engine):
        yield c


async def _complete(c, engine, model: str, headers=None) -> tuple[httpx.Response, object]:
    r = await c.post("/v1/completions", json={"model": model, "prompt": "hello " * 40,
                     "max_tokens": 1}, headers=headers or {})  # fmt: skip
    return r, (engine.added.pop() if r.status_code == 200 else None)


async def test_a_request_names_its_adapter_in_model(open_, engine) -> None:
    r, req = await _complete(open_, engine, "acme-sql")
    assert r.status_code == 200 and req.lora == "acme-sql"
    assert r.json()["model"] == "acme-sql"
    r, base = await _complete(open_, engine, "smol-test")
    assert base.lora == "" and r.json()["model"] == "smol-test"
    # the same prompt under another adapter (or none) names other KV blocks
    assert req.block_hashes and base.block_hashes
    assert not set(req.block_hashes) & set(base.block_hashes)
    _, again = await _complete(open_, engine, "acme-sql")
    assert again.block_hashes == req.block_hashes
    r, _ = await _complete(open_, engine, "nope")
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


async def test_models_lists_adapters_with_their_parent_and_no_path(open_) -> None:
    r = await open_.get("/v1/models")
    cards = {card["id"]: card for card in r.json()["data"]}
    assert list(cards) == ["smol-test", *ADAPTERS]
    assert cards["smol-test"]["parent"] is None
    assert all(cards[name]["parent"] == "smol-test" for name in ADAPTERS)
    assert "/srv" not in r.text
    one = await open_.get("/v1/models/both")
    assert one.status_code == 200 and one.json()["parent"] == "smol-test" and "/srv" not in one.text


async def test_a_tenant_sees_and_uses_only_its_adapters(keyed, engine) -> None:
    for headers, mine, other in ((ACME, "acme-sql", "beta-fr"), (BETA, "beta-fr", "acme-sql")):
        ids = [c["id"] for c in (await keyed.get("/v1/models", headers=headers)).json()["data"]]
        assert ids == ["smol-test", mine, "both"]
        r, req = await _complete(keyed, engine, mine, headers)
        assert r.status_code == 200 and req.lora == mine
        r, _ = await _complete(keyed, engine, other, headers)
        missing, _ = await _complete(keyed, engine, "no-such-adapter", headers)
        assert r.status_code == 404 and r.json() == {**missing.json(), "error": {
            **missing.json()["error"], "message": r.json()["error"]["message"]}}  # fmt: skip
        assert r.json()["error"]["message"] == f"the model `{other}` does not exist"
        assert (await keyed.get(f"/v1/models/{other}", headers=headers)).status_code == 404
    r, acme = await _complete(keyed, engine, "both", ACME)
    r, beta = await _complete(keyed, engine, "both", BETA)
    assert not set(acme.block_hashes) & set(beta.block_hashes), "tenants' pools stay apart"
