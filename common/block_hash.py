"""Names of full KV blocks for prefix caching: a sha256 chained over every token before the
block's end, rooted in the model and the request's cache scope (its tenant's pool and cache
salt). The frontend names a prompt's blocks (off the core's step loop); the core names what the
frontend could not (outputs). Both root them with hash_root, in the scope the frontend chose."""

from __future__ import annotations

import hashlib
from array import array

import msgspec

_encode = msgspec.json.Encoder().encode


def cache_scope(pool: str | None, salt: str) -> str:
    """A request's prefix-cache scope, sent as AddRequest.cache_salt: its pool (a tenant's own,
    or None for the one pool that sharing tenants use) and, within it, the client's cache salt.
    Two different (pool, salt) pairs never give one scope (a JSON pair, hashed to 64 hex
    characters so that the wire and the core's table of roots hold a bounded string)."""
    return hashlib.sha256(b"gapless-scope\0" + _encode((pool, salt))).hexdigest()


def adapter_scope(scope: str, lora: str) -> str:
    """The prefix-cache scope of a request run with LoRA adapter `lora` ("" : the base, whose
    scope stays `scope`): another adapter's KV differs for the same tokens, so it never meets."""
    if not lora:
        return scope
    return hashlib.sha256(b"gapless-lora\0" + _encode((scope, lora))).hexdigest()


def hash_root(model: str, scope: str) -> bytes:
    """The parent hash of a request's first block: one per model and cache scope."""
    return hashlib.sha256(b"gapless-kv\0" + model.encode() + b"\0" + scope.encode()).digest()


def chain_hashes(parent: bytes, token_ids: list[int], block_size: int) -> list[bytes]:
    """Hashes of the full blocks of token_ids (as int32), each chained to the one before it
    (the first to parent). ~1.4 us per 16-token block here."""
    data = array("i", token_ids).tobytes()
    step = 4 * block_size
    sha = hashlib.sha256
    out = []
    for i in range(0, len(token_ids) // block_size * step, step):
        parent = sha(parent + data[i : i + step]).digest()
        out.append(parent)
    return out
