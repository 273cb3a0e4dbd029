"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter at the frontend, with vLLM's bodies:
there only with --lora-dir, only for an admin key; a path outside --lora-dir's roots (links
resolved) is a 400 naming lora_path; a bad name, a refused adapter, an unknown one get clear
errors; a load shows in /v1/models at once, for the tenants the keys file lets use it."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator

import httpx
import pytest

from gapless.common.config import TenantSpec
from tests.frontend.conftest import build_app

pytestmark = pytest.mark.anyio

KEYS = {"sk-ops": "ops", "sk-acme": "acme", "sk-beta": "beta"}
TENANTS = {"acme": TenantSpec(lora_adapters=("sql",))}
OPS, ACME, BETA = ({"authorization": f"Bearer sk-{k}"} for k in ("ops", "acme", "beta"))


@pytest.fixture
def roots(tmp_path):
    """(root of --lora-dir, a directory outside it); the root holds adapters sql and fr (only
    their directories: the fake engine reads nothing), a file, and a link that leads out."""
    root, outside = tmp_path / "adapters", tmp_path / "elsewhere"
    for d in (root / "sql", root / "fr", outside):
        d.mkdir(parents=True)
    (root / "notes.txt").write_text("x")
    os.symlink(outside, root / "escape")
    (root / "leaky").mkdir()  # its weights file is a link out of the root
    (outside / "secret").write_text("x")
    os.symlink(outside / "secret", root / "leaky" / "adapter_model.safetensors")
    return root, outside


async def _client(config, engine) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=build_app(config, engine))
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
        yield c


@pytest.fixture
async def client(make_config, engine, roots) -> AsyncIterator[httpx.AsyncClient]:
    config = make_config(api_keys=KEYS, admin_keys=("sk-ops",), tenants=TENANTS,
                         enable_lora=True, lora_dirs=(str(roots[0]),))  # fmt: skip
    async for c in _client(config, engine):
        yield c


async def _load(c, name, path, headers=OPS, **more) -> httpx.Response:
    body = {"lora_name": name, "lora_path": str(path), **more}
    return await c.post("/v1/load_lora_adapter", json=body, headers=headers)


async def _models(c, headers) -> list[str]:
    return [card["id"] for card in (await c.get("/v1/models", headers=headers)).json()["data"]]


async def test_without_lora_dir_there_is_no_loading(make_config, engine, roots) -> None:
    config = make_config(api_keys=KEYS, admin_keys=("sk-ops",), enable_lora=True)
    async for c in _client(config, engine):
        assert (await _load(c, "sql", roots[0] / "sql")).status_code == 404
        r = await c.post("/v1/unload_lora_adapter", json={"lora_name": "sql"}, headers=OPS)
        assert r.status_code == 404
        paths = (await c.get("/openapi.json", headers=OPS)).json()["paths"]
        assert "/v1/load_lora_adapter" not in paths
    assert engine.lora_loads == []


async def test_only_an_admin_key_loads(client, engine, roots) -> None:
    assert (await _load(client, "sql", roots[0] / "sql", headers={})).status_code == 401
    r = await _load(client, "sql", roots[0] / "sql", headers=ACME)
    assert r.status_code == 403 and r.json()["error"]["code"] == "admin_key_required"
    r = await client.post("/v1/unload_lora_adapter", json={"lora_name": "sql"}, headers=BETA)
    assert r.status_code == 403
    assert engine.lora_loads == []


async def test_a_path_outside_the_roots_is_refused(client, engine, roots) -> None:
    root, outside = roots
    for path in (outside, root / "escape", root / ".." / "elsewhere", "/", root / "notes.txt",
                 root / "missing", "", root / "leaky"):  # fmt: skip
        r = await _load(client, "sql", path)
        assert r.status_code == 400, path
        assert r.json()["error"]["param"] == "lora_path", path
    assert engine.lora_loads == []


async def test_bad_bodies_and_names_get_a_400_naming_the_field(client, engine, roots) -> None:
    sql = roots[0] / "sql"
    for name, param in (("a/b", "lora_name"), ("", "lora_name"), ("smol-test", "lora_name")):
        r = await _load(client, name, sql)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, name
    r = await _load(client, "sql", sql, load_inplace=True)
    assert r.status_code == 400 and r.json()["error"]["param"] == "load_inplace"
    r = await client.post("/v1/load_lora_adapter", json={"lora_name": "sql"}, headers=OPS)
    assert r.status_code == 400 and "lora_path" in r.json()["error"]["message"]
    assert engine.lora_loads == []
    engine.lora_error = "sql: rank 32 is over --max-lora-rank 16"
    r = await _load(client, "sql", sql)
    assert r.status_code == 400 and r.json()["error"]["message"] == engine.lora_error
    assert r.json()["error"]["param"] == "lora_path"
    assert await _models(client, OPS) == ["smol-test"]


async def test_a_load_shows_at_once_to_the_tenants_it_belongs_to(client, engine, roots) -> None:
    root = roots[0]
    paths = (await client.get("/openapi.json", headers=OPS)).json()["paths"]
    assert paths["/v1/load_lora_adapter"]["post"]["operationId"] == "loadLoraAdapter"
    r = await _load(client, "sql", root / "sql")
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'sql' added successfully."
    assert engine.lora_loads[-1].path == os.path.realpath(root / "sql")
    assert await _models(client, ACME) == ["smol-test", "sql"]
    assert await _models(client, BETA) == ["smol-test"]
    body = {"model": "sql", "prompt": "hello", "max_tokens": 1}
    r = await client.post("/v1/completions", json=body, headers=ACME)
    assert r.status_code == 200 and engine.added[-1].lora == "sql"
    r = await client.post("/v1/completions", json=body, headers=BETA)
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    r = await client.post("/v1/unload_lora_adapter", json={"lora_name": "sql"}, headers=OPS)
    assert r.status_code == 200 and "'sql' removed" in r.text
    assert await _models(client, ACME) == ["smol-test"]
    r = await client.post("/v1/completions", json=body, headers=ACME)
    assert r.status_code == 404
    r = await client.post("/v1/unload_lora_adapter", json={"lora_name": "sql"}, headers=OPS)
    assert r.status_code == 404 and r.json()["error"]["param"] == "lora_name"


async def test_a_gguf_adapter_file_under_the_roots_is_loaded(client, engine, roots) -> None:
    """llama.cpp's LoRA files are single files: one under a root loads, one reached by a
    link out of the roots does not, and a file that is not GGUF is a 400 as before."""
    root, outside = roots
    (root / "sql.gguf").write_bytes(b"GGUF\x03\x00\x00\x00")
    (outside / "fr.gguf").write_bytes(b"GGUF\x03\x00\x00\x00")
    os.symlink(outside / "fr.gguf", root / "fr.gguf")
    r = await _load(client, "sql", root / "sql.gguf")
    assert r.status_code == 200 and engine.lora_loads[-1].path == os.path.realpath(
        root / "sql.gguf"
    )
    for path in (root / "fr.gguf", root / "notes.txt"):
        r = await _load(client, "fr", path)
        assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path", path
    assert len(engine.lora_loads) == 1
