"""A request's tenant and priority, as the frontend puts them in AddRequest."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from gapless.common.config import TenantSpec
from gapless.frontend.engine.tenants import ANONYMOUS, ApiKeys
from gapless.launch.keys_file import read_keys_file
from tests.frontend.conftest import build_app
from tests.frontend.fake_engine import FakeEngine

pytestmark = pytest.mark.anyio

KEYS = {"sk-acme": "acme", "sk-acme-2": "acme", "sk-beta": "beta"}
TENANTS = {"acme": TenantSpec(priority=-10), "beta": TenantSpec(weight=2.0)}
USER = [{"role": "user", "content": "hi"}]
ENDPOINTS = [("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions", {"messages": USER})]


@pytest.fixture
async def keyed(make_config, engine) -> AsyncIterator[httpx.AsyncClient]:
    """A server with a keys file and an operator key, `--api-key op`."""
    config = make_config(api_keys=KEYS, tenants=TENANTS, api_key="op")
    transport = httpx.ASGITransport(app=build_app(config, engine))
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
        yield c


async def _post(
    c: httpx.AsyncClient, engine: FakeEngine, path: str, body: dict[str, Any], **headers: str
) -> tuple[str, int]:
    """(tenant, priority) of the AddRequest the request made; x_tenant= sends X-Tenant."""
    headers = {name.replace("_", "-"): value for name, value in headers.items()}
    r = await c.post(path, json={**body, "max_tokens": 1}, headers=headers)
    assert r.status_code == 200, r.text
    req = engine.added.pop()
    return req.tenant, req.priority


@pytest.mark.parametrize(("path", "body"), ENDPOINTS)
async def test_the_keys_tenant_wins(keyed, engine, path, body) -> None:
    auth = {"authorization": "Bearer sk-acme"}
    assert await _post(keyed, engine, path, body, **auth) == ("acme", -10)
    claimed = {**body, "user": "beta"}
    assert await _post(keyed, engine, path, claimed, **auth, x_tenant="beta") == ("acme", -10)
    # what the key ignores is not checked either
    assert (await _post(keyed, engine, path, body, **auth, x_tenant="x" * 300))[0] == "acme"
    auth = {"authorization": "bearer  sk-acme-2 "}
    assert await _post(keyed, engine, path, body, **auth) == ("acme", -10)
    auth = {"authorization": "Bearer sk-beta"}
    assert await _post(keyed, engine, path, body, **auth, x_tenant="acme") == ("beta", 0)


async def test_unknown_keys_are_refused(keyed, engine) -> None:
    for auth in ("", "Bearer sk-gamma", "Bearer sk-acm", "Basic sk-acme", "Bearer acme"):
        r = await keyed.post(
            "/v1/completions", json={"prompt": "hi"}, headers={"authorization": auth}
        )
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert r.headers["www-authenticate"] == "Bearer"
        assert (await keyed.get("/v1/models", headers={"authorization": auth})).status_code == 401
    assert engine.added == []
    assert (await keyed.get("/health")).status_code == 200
    assert (await keyed.get("/metrics")).status_code == 200


async def test_the_operator_key_names_any_tenant(keyed, engine) -> None:
    """--api-key beside a keys file: its requests name their tenant, as without a keys file."""
    path, body = ENDPOINTS[0]
    auth = {"authorization": "Bearer op"}
    assert await _post(keyed, engine, path, body, **auth, x_tenant="acme") == ("acme", -10)
    assert await _post(keyed, engine, path, {**body, "user": "zed"}, **auth) == ("zed", 0)
    tenant, _ = await _post(keyed, engine, path, body, **auth)
    assert tenant.startswith("key-") and "op" not in tenant


@pytest.mark.parametrize(("path", "body"), ENDPOINTS)
async def test_without_keys_the_request_names_its_tenant(client, engine, path, body) -> None:
    assert await _post(client, engine, path, body) == ("", 0)
    assert await _post(client, engine, path, {**body, "user": "bob"}) == ("bob", 0)
    with_user = {**body, "user": "bob"}
    assert await _post(client, engine, path, with_user, x_tenant="team-a") == ("team-a", 0)
    assert await _post(client, engine, path, {**body, "user": ""}, x_tenant="") == ("", 0)


async def test_x_tenant_is_utf8_like_user(client, engine) -> None:
    path, body = ENDPOINTS[0]
    r = await client.post(path, json=body, headers={"x-tenant": "équipe—b".encode()})
    assert r.status_code == 200, r.text
    assert engine.added.pop().tenant == "équipe—b"
    assert await _post(client, engine, path, {**body, "user": "équipe—b"}) == ("équipe—b", 0)


@pytest.mark.parametrize(("path", "body"), ENDPOINTS)
@pytest.mark.parametrize(
    "header", [b"a\tb", b"a\x7fb", b"x" * 257, b"\xe9quipe", "\u0085".encode()]
)
async def test_a_bad_x_tenant_is_a_400(client, engine, path, body, header) -> None:
    r = await client.post(path, json=body, headers={"x-tenant": header})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "X-Tenant" and "X-Tenant" in error["message"]
    assert engine.added == []


PRIORITIES = [
    ("interactive", -10),
    ("default", 0),
    ("batch", 10),
    (-1000, -1000),
    (1000, 1000),
    (0, 0),
    (3, 3),
    (None, 0),
]


@pytest.mark.parametrize(("path", "body"), ENDPOINTS)
@pytest.mark.parametrize(("priority", "expected"), PRIORITIES)
async def test_priority_names_and_integers(client, engine, path, body, priority, expected) -> None:
    assert await _post(client, engine, path, {**body, "priority": priority}) == ("", expected)


async def test_an_absent_priority_is_the_tenants_default(make_config, engine) -> None:
    config = make_config(tenants={"batchy": TenantSpec(priority=10)})
    transport = httpx.ASGITransport(app=build_app(config, engine))
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
        path, body = ENDPOINTS[1]
        assert await _post(c, engine, path, body, x_tenant="batchy") == ("batchy", 10)
        given = {**body, "priority": "interactive"}
        assert await _post(c, engine, path, given, x_tenant="batchy") == ("batchy", -10)
        assert await _post(c, engine, path, body, x_tenant="other") == ("other", 0)


async def test_a_bad_priority_says_what_is_allowed(client, engine) -> None:
    r = await client.post("/v1/completions", json={"prompt": "hi", "priority": "urgent"})
    error = r.json()["error"]
    assert (r.status_code, error["param"]) == (400, "priority")
    assert error["message"] == (
        "priority must be an integer from -1000 to 1000 or one of interactive, default, batch; "
        "got 'urgent'"
    )


def test_the_keys_file_marks_admin_keys_and_sharing_tenants(tmp_path) -> None:
    path = tmp_path / "keys.json"
    path.write_text(
        json.dumps(
            {
                "sk-a": {"tenant": "a", "share_prefix_cache": True},
                "sk-a2": "a",
                "sk-ops": {"tenant": "ops", "admin": True},
                "sk-ops2": "ops",
            }
        )
    )
    keys, tenants, admin = read_keys_file(str(path))
    assert keys == {"sk-a": "a", "sk-a2": "a", "sk-ops": "ops", "sk-ops2": "ops"}
    assert admin == ("sk-ops",), "admin is the key's, not its tenant's"
    assert tenants["a"].share_prefix_cache and not tenants["ops"].share_prefix_cache
    path.write_text(
        json.dumps({"k1": {"tenant": "a", "share_prefix_cache": True},
                    "k2": {"tenant": "a", "share_prefix_cache": False}})
    )  # fmt: skip
    with pytest.raises(ValueError, match="entries 1 and 2 .* different share_prefix_cache"):
        read_keys_file(str(path))
    for bad in ({"tenant": "a", "admin": "yes"}, {"tenant": "a", "share_prefix_cache": 1}):
        path.write_text(json.dumps({"k1": bad}))
        with pytest.raises(ValueError, match="entry 1"):
            read_keys_file(str(path))


def test_callers_and_their_admin_flag(make_config) -> None:
    config = make_config(
        api_keys={"sk-a": "a", "sk-ops": "ops", "sk-ops2": "ops"},
        admin_keys=("sk-ops",),
        admin_api_key="root",
        api_key="op",
    )
    keys = ApiKeys(config)
    a, ops, ops2 = (keys.authorize(f"Bearer {k}") for k in ("sk-a", "sk-ops", "sk-ops2"))
    assert (a.tenant, a.fixed, a.admin) == ("a", True, False)
    assert (ops.tenant, ops.fixed, ops.admin) == ("ops", True, True)
    assert not ops2.admin
    root, op = keys.authorize("Bearer root"), keys.authorize("Bearer op")
    assert root.admin and not root.fixed and root.tenant.startswith("key-")
    assert not op.admin and op.tenant != root.tenant
    assert ApiKeys(make_config()).authorize("") is ANONYMOUS and ANONYMOUS.admin
