"""Prefix caches are per tenant: the AddRequests the frontend builds, run through a real
Scheduler, find only their own tenant's blocks (and, opted in, the shared pool's), whether the
frontend names the prompt's blocks or the core does."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import msgspec
import pytest

from gapless.common.block_hash import cache_scope, chain_hashes, hash_root
from gapless.common.config import EngineConfig, TenantSpec
from gapless.common.messages import AddRequest
from gapless.core.scheduler import Scheduler
from tests.core.test_prefix_cache import run_to_end
from tests.core.test_scheduler import make_scheduler
from tests.frontend.conftest import MAX_MODEL_LEN, build_app
from tests.frontend.fake_engine import FakeEngine

pytestmark = pytest.mark.anyio

PROMPT = list(range(1000, 1070))  # token ids: 4 full blocks of 16 before its last token
ALL = 64  # prompt tokens a repeat finds cached
KEYS = {"sk-a": "a", "sk-b": "b", "sk-c": "c", "sk-d": "d"}
SHARING = {"c": TenantSpec(share_prefix_cache=True), "d": TenantSpec(share_prefix_cache=True)}
_ids = itertools.count()


class Cache:
    """One app in front of a FakeEngine and one Scheduler that runs what the app sends."""

    def __init__(
        self, client: httpx.AsyncClient, engine: FakeEngine, model: str, core_hashes: bool
    ) -> None:
        self.client, self.engine, self.core_hashes = client, engine, core_hashes
        self.scheduler: Scheduler = make_scheduler(
            block_size=16, num_blocks=64, max_model_len=MAX_MODEL_LEN, model_salt=model
        )

    async def cached(
        self, key: str | None = None, headers: dict[str, str] | None = None, **body: Any
    ) -> int:
        """Prompt tokens the core finds cached for this request; it then runs to the end, so
        its blocks stay cached for the next."""
        headers = dict(headers or {})
        if key:
            headers["authorization"] = f"Bearer {key}"
        body = {"prompt": PROMPT, "max_tokens": 1, **body}
        r = await self.client.post("/v1/completions", json=body, headers=headers)
        assert r.status_code == 200, r.text
        msg: AddRequest = self.engine.added.pop()
        msg = msgspec.structs.replace(msg, request_id=f"r{next(_ids)}")
        if self.core_hashes:  # the core names the blocks from the scope alone
            msg = msgspec.structs.replace(msg, block_hashes=[])
        req = self.scheduler.add_request(msg)
        run_to_end(self.scheduler)
        return req.num_cached_prompt


@pytest.fixture(params=[False, True], ids=["frontend-hashes", "core-hashes"])
async def make_cache(
    request, make_config: Callable[..., EngineConfig], engine: FakeEngine
) -> AsyncIterator[Callable[..., Cache]]:
    """make_cache(**config_overrides) -> Cache."""
    clients: list[httpx.AsyncClient] = []

    def make(**overrides: Any) -> Cache:
        config = make_config(**overrides)
        transport = httpx.ASGITransport(app=build_app(config, engine))
        clients.append(httpx.AsyncClient(transport=transport, base_url="http://t"))
        return Cache(clients[-1], engine, config.model.path, request.param)

    yield make
    for client in clients:
        await client.aclose()


async def test_another_tenants_prompt_is_not_cached_for_you(make_cache) -> None:
    cache = make_cache(api_keys=KEYS)
    assert await cache.cached("sk-a") == 0
    assert await cache.cached("sk-b") == 0, "b must not find a's blocks"
    assert await cache.cached("sk-a") == ALL, "a's own repeat hits"
    assert await cache.cached("sk-b") == ALL, "and so does b's"
    # nothing the client says moves it into another tenant's pool
    assert await cache.cached("sk-c", headers={"x-tenant": "a"}, user="a") == 0


async def test_a_cache_salt_divides_a_tenants_pool(make_cache) -> None:
    cache = make_cache(api_keys=KEYS)
    assert await cache.cached("sk-a") == 0
    assert await cache.cached("sk-a", cache_salt="s") == 0
    assert await cache.cached("sk-a", cache_salt="s") == ALL
    assert await cache.cached("sk-b", cache_salt="s") == 0, "the same salt, another tenant"


async def test_tenants_that_opt_in_share_one_pool(make_cache) -> None:
    cache = make_cache(api_keys=KEYS, tenants=SHARING)
    assert await cache.cached("sk-a") == 0
    assert await cache.cached("sk-c") == 0, "a tenant that did not opt in keeps its own"
    assert await cache.cached("sk-d") == ALL
    assert await cache.cached("sk-d", cache_salt="x") == 0
    assert await cache.cached("sk-c", cache_salt="x") == ALL
    assert await cache.cached("sk-b") == 0


async def test_the_server_wide_flag_shares_every_tenants_cache(make_cache) -> None:
    cache = make_cache(api_keys=KEYS, shared_prefix_cache=True)
    assert await cache.cached("sk-a") == 0
    assert await cache.cached("sk-b") == ALL
    assert await cache.cached("sk-b", cache_salt="s") == 0


async def test_without_keys_the_requests_tenant_divides_the_cache(make_cache) -> None:
    cache = make_cache()
    assert await cache.cached(headers={"x-tenant": "t1"}) == 0
    assert await cache.cached(headers={"x-tenant": "t2"}) == 0
    assert await cache.cached(user="t1") == ALL, "`user` names the same tenant t1"
    assert await cache.cached() == 0
    assert await cache.cached() == ALL, "requests that name no tenant share the default one"


def test_scopes_are_apart() -> None:
    scopes = {
        cache_scope(pool, salt)
        for pool in (None, "", "a", "a\x00", "null", '"a"')
        for salt in ("", "a", "\x00", '"', "null")
    }
    assert len(scopes) == 30
    assert cache_scope("a", "s") == cache_scope("a", "s")
    root = hash_root("m", cache_scope("a", ""))
    assert chain_hashes(root, PROMPT, 16) != chain_hashes(hash_root("m", ""), PROMPT, 16)


def test_the_cores_roots_stay_bounded() -> None:
    """Tenants and salts are the clients' to choose: the core keeps a bounded table of roots."""
    s = make_scheduler(block_size=4)
    for i in range(5000):
        s.prefix._root(cache_scope(f"t{i}", ""))
    assert len(s.prefix._roots) <= 4096
    scope = cache_scope("a", "")
    assert s.prefix._root(scope) == hash_root(s.prefix._model_salt, scope)
