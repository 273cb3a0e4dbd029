"""--api-keys-file: the API keys a server accepts, each key's tenant, and each tenant's settings.

The file is one JSON object, key -> a tenant name, or key -> an object:

    {"sk-a1": "acme", "sk-b2": {"tenant": "beta", "weight": 2, "priority": "batch",
                                 "max_queued_requests": 100, "share_prefix_cache": true,
                                 "lora_adapters": ["beta-support"]},
     "sk-ops": {"tenant": "ops", "admin": true}}

A tenant setting left out leaves it to another key of the same tenant, else to TenantSpec's
default; two keys of one tenant that give a setting different values are an error. `admin` is
the key's own: that key (not the tenant's other keys) reads /v1/engine/* and all of /metrics.
"""

from __future__ import annotations

import math
from typing import Annotated, NamedTuple

import msgspec

from gapless.common.config import TenantSpec, check_tenant_name, priority_value


class KeyEntry(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    tenant: str
    weight: float | None = None
    priority: int | str | None = None
    max_queued_requests: Annotated[int, msgspec.Meta(ge=1)] | None = None
    share_prefix_cache: bool | None = None
    lora_adapters: tuple[str, ...] | None = None
    admin: bool = False


_entry_decoder = msgspec.json.Decoder(str | KeyEntry)
_SETTINGS = ("weight", "priority", "max_queued_requests", "share_prefix_cache", "lora_adapters")


class KeysFile(NamedTuple):
    keys: dict[str, str]  # key -> tenant
    tenants: dict[str, TenantSpec]
    admin_keys: tuple[str, ...]  # the keys marked admin


def read_keys_file(path: str) -> KeysFile:
    """The file's keys, tenants and admin keys; ValueError naming the file and the entry."""
    try:
        with open(path, "rb") as f:
            text = f.read()
    except OSError as e:
        raise ValueError(f"--api-keys-file {path}: cannot read it: {e.strerror}") from None
    try:
        raw = msgspec.json.decode(text, type=dict[str, msgspec.Raw])
    except msgspec.DecodeError as e:
        raise ValueError(f"--api-keys-file {path}: not a JSON object of keys: {e}") from None
    if not raw:
        raise ValueError(f"--api-keys-file {path}: holds no keys")
    keys: dict[str, str] = {}
    admin: list[str] = []
    # tenant -> setting name -> (entry number, value)
    settings: dict[str, dict[str, tuple[int, float | int | bool]]] = {}
    # why entries go by number: an error message must not print the secret key
    for number, (key, value) in enumerate(raw.items(), 1):
        try:
            entry = _entry(key, value)
        except (ValueError, msgspec.DecodeError) as e:
            raise ValueError(f"--api-keys-file {path}: entry {number}: {e}") from None
        keys[key] = entry.tenant
        if entry.admin:
            admin.append(key)
        given = settings.setdefault(entry.tenant, {})
        for name in _SETTINGS:
            value = getattr(entry, name)
            if value is None:
                continue
            first, earlier = given.setdefault(name, (number, value))
            if earlier != value:
                raise ValueError(
                    f"--api-keys-file {path}: entries {first} and {number} give tenant "
                    f"{entry.tenant!r} different {name} values ({earlier} and {value})"
                )
    tenants = {
        tenant: TenantSpec(**{name: value for name, (_, value) in given.items()})
        for tenant, given in settings.items()
    }
    return KeysFile(keys, tenants, tuple(admin))


def _entry(key: str, value: msgspec.Raw) -> KeyEntry:
    """One entry, checked, with its priority as an integer."""
    if not key or not all("!" <= c <= "~" for c in key):
        raise ValueError("a key must be visible ASCII characters, without spaces, and not empty")
    decoded = _entry_decoder.decode(value)
    entry = KeyEntry(tenant=decoded) if isinstance(decoded, str) else decoded
    if not entry.tenant:
        raise ValueError("the tenant name is empty")
    try:
        check_tenant_name(entry.tenant)
    except ValueError as e:
        raise ValueError(f"the tenant name {e}") from None
    if entry.weight is not None and not (math.isfinite(entry.weight) and entry.weight > 0):
        raise ValueError(f"weight must be a positive number, got {entry.weight}")
    if entry.priority is not None:
        try:
            entry.priority = priority_value(entry.priority)
        except ValueError as e:
            raise ValueError(f"priority {e}") from None
    return entry
