"""KV cache events as vLLM 0.33.0 publishes them (vllm/distributed/kv_events.py), for routers
that place requests by which server holds a prompt's prefix (llm-d's KV-cache indexer, NVIDIA
Dynamo's KV router).

Wire format (msgspec msgpack): a batch is an array `[ts, [event, ...], data_parallel_rank]`;
each event is a map tagged by `"type"` (`BlockStored`, `BlockRemoved`, `AllBlocksCleared`), the
map encoding vLLM uses since 0.26 (before it, positional arrays). Fields without a default are
always written, as vLLM's decoder requires them. These are not gapless's own channel messages
(those are in common/messages.py): their shape is fixed by the consumers, not by us.

Block hashes are gapless's own (common/block_hash.py): 32-byte sha256 chains rooted in the
model and the request's cache scope. The scope travels as vLLM carries `cache_salt`: in the
`extra_keys` entry of a chain's first block (None for the others, as their parent fixes them).
"""

from __future__ import annotations

import msgspec

MEDIUM = "GPU"  # vLLM names the device tier "GPU" whatever the device; consumers filter on it


class KvEvent(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """One change to the set of block hashes a prefix lookup can hit."""


class BlockStored(KvEvent):
    """Full blocks that became reusable, a chain: block_hashes[0]'s parent is
    parent_block_hash (None: the chain starts at the scope's root), each next one's the one
    before it. token_ids: the blocks' tokens, block_size each."""

    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None  # deprecated in vLLM, still written (its decoder requires it)
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[str, ...] | None] | None = None  # per block; the scope on the first


class BlockRemoved(KvEvent):
    """Blocks the cache dropped (evicted for other content): a lookup no longer hits them."""

    block_hashes: list[bytes]
    medium: str | None


class AllBlocksCleared(KvEvent):
    """The cache holds nothing reusable: at engine start and when the prefix cache is reset."""


Event = BlockStored | BlockRemoved | AllBlocksCleared


class KvEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """What one publish carries: the events of one engine step, in order."""

    ts: float  # time.time() when the step's events were taken
    events: list[Event]
    data_parallel_rank: int | None = None  # the replica


class KvEventLog:
    """Collects a step's events as the block manager changes what can hit; the engine takes
    them after each step. Consecutive removals are merged into one event."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.events: list[Event] = []

    def stored(
        self, hashes: list[bytes], parent: bytes | None, token_ids: list[int], scope: str
    ) -> None:
        extra: list[tuple[str, ...] | None] = [None] * len(hashes)
        if parent is None:  # why only there: vLLM hashes cache_salt into the first block only
            extra[0] = (scope,)
        self.events.append(
            BlockStored(hashes, parent, token_ids, self.block_size, None, MEDIUM, None, extra)
        )

    def removed(self, hashes: list[bytes]) -> None:
        last = self.events[-1] if self.events else None
        if isinstance(last, BlockRemoved):
            last.block_hashes += hashes
        else:
            self.events.append(BlockRemoved(hashes, MEDIUM))

    def cleared(self) -> None:
        self.events.append(AllBlocksCleared())

    def take(self) -> list[Event]:
        out, self.events = self.events, []
        return out
