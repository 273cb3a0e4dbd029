"""Paged KV block accounting with prefix caching, and runner slot accounting (pure CPU
bookkeeping).

Prefix caching. A full block is named by a chained hash (core/common/block_hash.py):
sha256(parent's hash + its token ids as int32), the first block's parent being a root made of
the model and the request's `cache_salt`, so requests that must not share never meet. `BlockManager` maps each hash to the
one block holding that KV, counts references, keeps blocks nobody references cached in least
recently used order, and evicts the oldest when it needs a block and none is empty.

Invariants (tests/core/test_prefix_cache.py checks them after every step, overlap on and off):
1. A block is in exactly one place: the empty list, the cached LRU (no reference, a hash), or
   held by one or more requests (ref > 0). Block 0 is in none (padding writes it).
2. A hash names a block only once the steps that write that block's KV have all been sent to
   the runner. The runner runs plans in order, so any step that reads the block (a request that
   hits it is planned later) runs after those writes. The scheduler registers prompt blocks when
   it builds the step that fills them and output blocks when the request leaves its slot
   (their ids are known only then), and only positions whose ids are known.
3. A block a request holds is never evicted: eviction takes only unreferenced blocks. A step in
   flight may still write a block its request has since left (preempted, finished); that block
   is either empty (no hash) or cached under a hash of exactly what that step writes (2), and a
   later owner's writes are planned later, so they land after it (the same in-order argument
   as freeing without caching).
4. A cached block is never written again: a request takes at most (its tokens - 1) // size
   cached blocks, so it computes at least its last token, into a block of its own.
5. Eviction drops the hash before the block is handed out, so no later lookup can hit it.
"""

from __future__ import annotations

from collections import OrderedDict, deque

from gapless.core.common.block_hash import chain_hashes, hash_root

__all__ = ["BlockManager", "SlotManager", "chain_hashes", "hash_root"]


class BlockManager:
    """Hands out KV block ids. Block 0 is reserved: padded entries on the runner write there.

    `caching` off: no block is ever registered, so freed blocks go back empty and nothing hits.
    Per-block work is a tight loop over Python lists and dicts: on lists of tens of blocks that
    beats numpy's per-call cost (measured here: naming 64 fresh blocks ~10 us, freeing them
    ~16 us, 9 of which without caching).
    """

    def __init__(self, num_blocks: int, block_size: int, caching: bool = True) -> None:
        assert num_blocks >= 2, "need at least one usable KV block"
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.caching = caching
        self._empty: deque[int] = deque(range(1, num_blocks))  # no reference, no hash
        self._cached: OrderedDict[int, None] = OrderedDict()  # no reference, a hash; LRU first
        self._ref = [0] * num_blocks  # requests holding each block
        self._hash: list[bytes | None] = [None] * num_blocks  # a named block's hash
        self._by_hash: dict[bytes, int] = {}
        self.num_evictions = 0  # cached blocks reused for other content

    @property
    def num_free(self) -> int:
        """Blocks an allocation may take: empty ones and unreferenced cached ones."""
        return len(self._empty) + len(self._cached)

    @property
    def num_usable(self) -> int:
        return self.num_blocks - 1

    @property
    def num_cached(self) -> int:
        """Blocks holding KV under a hash, referenced or not."""
        return len(self._by_hash)

    @property
    def num_cached_free(self) -> int:
        """Cached blocks no request holds: kept until an allocation evicts them."""
        return len(self._cached)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    def allocate(self, n: int) -> list[int]:
        """n blocks for new content, empty ones first, then the least recently used cached."""
        assert self.can_allocate(n), "allocate without can_allocate"
        empty = self._empty
        out = [empty.popleft() for _ in range(min(n, len(empty)))]
        if n > len(out):  # evict; with a full cache (a server that has run a while) always
            popitem, k = self._cached.popitem, n - len(out)
            evicted = [popitem(False)[0] for _ in range(k)]
            # drop their names before anyone can look them up again (invariant 5); why map and
            # a zero-length deque: the loop runs in C, an eviction per block of every prompt
            names = self._hash
            deque(map(self._by_hash.pop, map(names.__getitem__, evicted)), maxlen=0)
            for b in evicted:
                names[b] = None
            self.num_evictions += k
            out += evicted
        ref = self._ref
        for b in out:
            ref[b] = 1
        return out

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block (a request's blocks are distinct). A block nobody
        holds stays cached if it has a hash; the tail of a sequence goes first into the LRU, so
        it is evicted before the prefix it extends."""
        ref, names, cached, empty = self._ref, self._hash, self._cached, self._empty
        for b in reversed(blocks):
            r = ref[b] - 1
            assert r >= 0, f"double free of KV block {b}"
            ref[b] = r
            if r == 0:
                if names[b] is not None:
                    cached[b] = None
                else:
                    empty.append(b)

    # prefix caching

    def lookup(self, hashes: list[bytes]) -> list[int]:
        """The blocks of the longest cached prefix of a chain of hashes (nothing is taken)."""
        out = []
        by_hash = self._by_hash
        for h in hashes:
            b = by_hash.get(h)
            if b is None:
                break
            out.append(b)
        return out

    def num_unreferenced(self, blocks: list[int]) -> int:
        """How many of these cached blocks nobody holds: taking them lowers num_free."""
        ref = self._ref
        return sum(1 for b in blocks if ref[b] == 0)

    def take(self, blocks: list[int]) -> None:
        """A reference to each of these cached blocks (from lookup)."""
        ref, cached = self._ref, self._cached
        for b in blocks:
            assert self._hash[b] is not None, f"KV block {b} is not cached"
            if ref[b] == 0:
                del cached[b]
            ref[b] += 1

    def register(self, blocks: list[int], hashes: list[bytes]) -> None:
        """Name held, full blocks by their hashes so later requests can hit them. A block that
        has a name keeps it; a hash that already names another block is left to that one (two
        requests computed the same prefix at once: the second copy stays unnamed)."""
        if not self.caching:
            return
        by_hash, names = self._by_hash, self._hash
        if by_hash.keys().isdisjoint(hashes) and not any(map(names.__getitem__, blocks)):
            # the usual case, unnamed blocks of new content: the map in bulk (measured: this
            # path is half the per-block loop's time, and it runs for every prompt block)
            by_hash.update(zip(hashes, blocks, strict=True))
            for b, h in zip(blocks, hashes, strict=True):
                names[b] = h
            return
        for b, h in zip(blocks, hashes, strict=True):
            if names[b] is None and h not in by_hash:
                by_hash[h] = b
                names[b] = h

    def check(self) -> None:
        """Assert invariants 1 and 5 (tests; walks every block)."""
        empty, cached = set(self._empty), set(self._cached)
        assert len(empty) == len(self._empty) and not (empty & cached)
        assert 0 not in empty and 0 not in cached and self._ref[0] == 0
        for b in range(1, self.num_blocks):
            held = self._ref[b] > 0
            assert held + (b in empty) + (b in cached) == 1, f"KV block {b} in two places"
            if b in empty:
                assert self._hash[b] is None
            if b in cached:
                assert self._hash[b] is not None
        assert sum(h is not None for h in self._hash) == len(self._by_hash)
        for h, b in self._by_hash.items():
            assert self._hash[b] == h


class SlotManager:
    """Seats in the runner's persistent batch. A freed slot is announced in the next plan."""

    def __init__(self, num_slots: int) -> None:
        self._free: deque[int] = deque(range(num_slots))
        self._freed_since_plan: list[int] = []

    def allocate(self) -> int:
        return self._free.popleft()

    def free(self, slot: int) -> None:
        assert slot not in self._free, f"double free of slot {slot}"
        self._free.append(slot)
        self._freed_since_plan.append(slot)

    def take_freed(self) -> list[int]:
        out, self._freed_since_plan = self._freed_since_plan, []
        return out
