"""Who sends a request: its API key, its tenant, its priority and its prefix-cache scope.

With --api-keys-file the key decides the tenant and nothing the client says can change it. Without
one (and for the --api-key and --admin-api-key keys), the request names its tenant: the X-Tenant
header, else the OpenAI `user` field, else one shared tenant. An admin key (--admin-api-key, or
`"admin": true` in the keys file) also reads the engine routes and every tenant's metrics.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace

from gapless.common.block_hash import cache_scope
from gapless.common.config import EngineConfig, TenantSpec, check_tenant_name, priority_value
from gapless.frontend.http.errors import ApiError, bad_request

_NO_SETTINGS = TenantSpec()


@dataclass(frozen=True, slots=True)
class Caller:
    """What a request's API key says about it."""

    tenant: str  # the key's tenant if fixed, else the tenant of a request that names none
    fixed: bool = False  # the key decides the tenant
    admin: bool = False  # may read the engine routes and every tenant's metrics


# no key configured, or an open route: nothing there is kept from anyone
ANONYMOUS = Caller("", admin=True)


class ApiKeys:
    """The keys a server accepts: --api-key, --admin-api-key and every key of --api-keys-file."""

    def __init__(self, config: EngineConfig) -> None:
        admin = {_digest(key.encode()) for key in (*config.admin_keys, config.admin_api_key) if key}
        # why by digest: a dict lookup of a digest leaks no timing about the keys themselves
        callers = self._callers = {
            _digest(key.encode()): Caller(tenant, fixed=True)
            for key, tenant in config.api_keys.items()
        }
        for key in (config.admin_api_key, config.api_key):
            if key:
                digest = _digest(key.encode())
                # tenant of a request that names none: who holds the key, not the key itself
                callers.setdefault(digest, Caller("key-" + digest.hex()[:12]))
        for digest in admin:
            callers[digest] = replace(callers[digest], admin=True)

    def authorize(self, authorization: str) -> Caller:
        """The caller behind `Authorization: Bearer <key>`; 401 unless the key is one of ours;
        ANONYMOUS when the server has no key."""
        if not self._callers:
            return ANONYMOUS
        scheme, _, token = authorization.partition(" ")
        caller = self._callers.get(_digest(token.strip().encode("latin-1")))
        if scheme.lower() != "bearer" or caller is None:
            raise ApiError(
                401,
                "missing or wrong API key; send `Authorization: Bearer <key>`",
                code="invalid_api_key",
                headers=[(b"www-authenticate", b"Bearer")],
            )
        return caller


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


def tenant_of(caller: Caller, header: str | None, user: str | None) -> str:
    """The key's tenant if it fixes one; else X-Tenant, else `user`, else the caller's."""
    if caller.fixed:
        return caller.tenant
    if header:
        try:  # why: the header came as latin-1; as UTF-8 it names the tenant `user` would
            header = header.encode("latin-1").decode("utf-8")
        except UnicodeDecodeError:
            raise bad_request("the tenant (X-Tenant) is not UTF-8", param="X-Tenant") from None
    for name, tenant in (("X-Tenant", header), ("user", user)):
        if tenant:
            try:
                check_tenant_name(tenant)
            except ValueError as e:
                raise bad_request(f"the tenant ({name}) {e}", param=name) from None
            return tenant
    return caller.tenant


def cache_scope_of(tenant: str, salt: str, config: EngineConfig) -> str:
    """The request's prefix-cache scope (block_hash.cache_scope): its tenant's own pool, or the
    shared one with --shared-prefix-cache or the tenant's share_prefix_cache; `salt` (the
    client's cache_salt, "" if none) divides either further."""
    spec = config.tenants.get(tenant, _NO_SETTINGS)
    shared = config.shared_prefix_cache or spec.share_prefix_cache
    return cache_scope(None if shared else tenant, salt)


def priority_of(value: int | str | None, tenant: str, config: EngineConfig) -> int:
    """The request's priority as an integer; absent, its tenant's default."""
    if value is None:
        return config.tenants.get(tenant, _NO_SETTINGS).priority
    try:
        return priority_value(value)
    except ValueError as e:
        raise bad_request(f"priority {e}", param="priority") from None
