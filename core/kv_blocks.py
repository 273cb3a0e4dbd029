"""Paged KV block accounting with prefix caching, and runner slot accounting (pure CPU
bookkeeping).

Prefix caching. A full block is named by a chained hash (common/block_hash.py):
sha256(parent's hash + its token ids as int32), the first block's parent being a root made of
the model and the request's `cache_salt`, so requests that must not share never meet.
`BlockManager` maps hashes to the blocks holding that KV, counts references, keeps blocks
nobody references in least recently used order, and evicts the oldest when it needs a block
and none is empty.

Names are given lazily, because at 0% hits naming every block is pure cost. When a request's
blocks become reusable (`register`), only its first block (its *head*) is put in the map at
once; the rest wait as a *fragment* filed under the head's hash (the request's block and
hash lists with the range registered, the tokens to hash for blocks whose hashes are not known,
and the allocation clock). A lookup that finds a head names its waiting fragments first, and
only then walks the chain. A lookup that misses the head (every lookup when prompts are
distinct) costs one dict probe, and a fragment nobody asks for is dropped with its head when
that is evicted. A fragment's block is named only if no allocation has handed it
out since the fragment was filed (the block's stamp is not newer than the fragment's clock).
With KV events on (--kv-events-endpoint), names are given when blocks are registered instead
(`register_now`): a router must hear of a block when it becomes reusable, and each name given
or dropped is logged (common/kv_events.py), so replaying the events rebuilds the map of names.

Invariants (tests/core/test_prefix_cache.py checks them after every step, overlap on and off):
1. A block is in exactly one place: the empty list, the LRU (no reference, reusable KV), or
   held by one or more requests (ref > 0). Block 0 is in none (padding writes it).
2. A block is registered, and so can be named, only once the steps that write its KV have all
   been sent to the runner. The runner runs plans in order, so any step that reads the block
   (a request that hits it is planned later) runs after those writes. The scheduler registers
   a running request's blocks, as far as its planned steps (all sent) have filled them and
   their ids are known, when a lookup finds a request of the same first block running, when
   they fall out of a sliding window (6), and the rest when it leaves its slot.
3. A block a request holds is never evicted: eviction takes only unreferenced blocks. A step in
   flight may still write a block its request has since left (preempted, finished); that block
   is either empty (not reusable) or registered with exactly what that step writes (2), and a
   later owner's writes are planned later, so they land after it (the same in-order argument
   as freeing without caching).
4. A reusable block is never written again: a request takes at most (its tokens - 1) // size
   cached blocks, so it computes at least its last token, into a block of its own.
5. Eviction drops the block's name (and, for a head, its waiting fragments) and stamps it
   before it is handed out, so no later lookup can hit it and no fragment can name it.
6. When every layer slides (core/window.py), a running request gives back its leading blocks
   that lie wholly behind the window of the step being planned: no step planned from now on
   reads them, and those planned before run first (the in-order argument of 3). It registers
   them first, so they join the LRU named, and gives back only registered ones while it can
   still register: while none went back unregistered and its head, once given back, is still
   named. Past that (caching off, or the head evicted) they go back empty and the request
   registers nothing more: `register` names the head it is handed, and a head given back and
   evicted may hold another request's KV. A hit on such a block needs its whole chain from the
   head still cached (lookup stops at the first missing name). The request's block list keeps
   them (fragments read it; the runner's table keeps them, masked): its first
   `RunningBatch.num_freed` entries are no longer its own, and leaving its slot frees the rest.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator
from itertools import islice

from gapless.common.block_hash import chain_hashes, hash_root
from gapless.common.kv_events import KvEventLog

__all__ = ["BlockManager", "SlotManager", "chain_hashes", "hash_root"]

# (clock when filed, the request's blocks, start, stop, its hashes, how many were known, the
# tokens of the blocks past those)
Fragment = tuple[int, list[int], int, int, list[bytes], int, "list[int] | None"]


class BlockManager:
    """Hands out KV block ids. Block 0 is reserved: padded entries on the runner write there.

    `caching` off: nothing is ever registered, so freed blocks go back empty and nothing hits.
    Per-block work is a tight loop over Python lists: on lists of tens of blocks that beats
    numpy's per-call cost. The LRU is a deque with lazy deletion: a hit leaves the block's entry
    in place and counts it stale, and eviction skips stale entries; with none (no hits since the
    last compaction) eviction is a bulk pop. Moving entries of an ordered dict instead costs
    several times a deque append per block.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        caching: bool = True,
        events: KvEventLog | None = None,
    ) -> None:
        assert num_blocks >= 2, "need at least one usable KV block"
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.caching = caching
        # with events, blocks are named when registered (register_now), not lazily: a router
        # must hear of a block when it becomes reusable, and every name change is logged
        self.events = events
        self._empty: deque[int] = deque(range(1, num_blocks))  # no reference, nothing reusable
        self._lru: deque[int] = deque()  # freed reusable blocks, oldest first, stale entries too
        self._stale: dict[int, int] = {}  # stale entries per block, all older than its live one
        self._num_lru = 0  # live entries: reusable blocks no request holds
        self._ref = [0] * num_blocks  # requests holding each block
        self._num_reusable = 0  # blocks registered and not evicted since
        self._hash: list[bytes | None] = [None] * num_blocks  # a named block's hash
        self._by_hash: dict[bytes, int] = {}
        self._pending: dict[bytes, list[Fragment]] = {}  # fragments waiting under their head
        self._stamp = [0] * num_blocks  # the eviction that last handed each block out
        self._clock = 0
        self.num_evictions = 0  # reusable blocks taken for other content

    @property
    def num_free(self) -> int:
        """Blocks an allocation may take: empty ones and unreferenced reusable ones."""
        return len(self._empty) + self._num_lru

    @property
    def num_usable(self) -> int:
        return self.num_blocks - 1

    @property
    def num_cached(self) -> int:
        """Blocks holding reusable KV, referenced or not (named or waiting for a lookup)."""
        return self._num_reusable

    @property
    def num_cached_free(self) -> int:
        """Reusable blocks no request holds: kept until an allocation evicts them."""
        return self._num_lru

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    def allocate(self, n: int) -> list[int]:
        """n blocks for new content, empty ones first, then the least recently used cached."""
        assert self.can_allocate(n), "allocate without can_allocate"
        empty, ref = self._empty, self._ref
        out = [empty.popleft() for _ in range(min(n, len(empty)))]
        for b in out:
            ref[b] = 1
        if n > len(out):  # with a full cache (a server that has run a while) always
            out += self._evict(n - len(out))
        return out

    def _evict(self, k: int) -> list[int]:
        """k blocks out of the LRU, nameless and held once."""
        lru = self._lru
        if not self._stale:  # no stale entries: the usual case, a bulk pop
            out = [lru.popleft() for _ in range(k)]
        else:  # pop until k live entries came out
            out = list(islice(self._skip_stale(iter(lru.popleft, None)), k))
        self._num_lru -= k
        self._num_reusable -= k
        self.num_evictions += k
        self._clock = clock = self._clock + 1
        stamp, names, ref = self._stamp, self._hash, self._ref
        dropped = []
        for b in out:
            ref[b] = 1
            stamp[b] = clock
            h = names[b]
            if h is not None:  # invariant 5
                names[b] = None
                del self._by_hash[h]
                self._pending.pop(h, None)
                dropped.append(h)
        if dropped and self.events is not None:
            self.events.removed(dropped)
        return out

    def free(self, blocks: list[int], num_reusable: int = 0) -> None:
        """Drop one reference to each of a request's blocks (distinct), the first
        `num_reusable` of them registered. A registered block nobody holds joins the LRU, the
        tail of a sequence first, so it is evicted before the prefix it extends; any other goes
        back empty. Which blocks are registered is known by position, not kept per block: a
        request registers its blocks in order, and the blocks it took from the cache lead."""
        ref, empty, lru = self._ref, self._empty, self._lru
        for b in reversed(blocks[num_reusable:]):
            r = ref[b] - 1
            assert r >= 0, f"double free of KV block {b}"
            ref[b] = r
            if r == 0:
                empty.append(b)
        queued = len(lru)
        for b in reversed(blocks[:num_reusable]):
            r = ref[b] - 1
            assert r >= 0, f"double free of KV block {b}"
            ref[b] = r
            if r == 0:
                lru.append(b)
        self._num_lru += len(lru) - queued
        if len(lru) > 2 * self.num_blocks:
            self._compact()

    def _compact(self) -> None:
        """Drop the LRU's stale entries (a long run of hits on blocks that are never evicted
        would grow it without bound)."""
        live = list(self._skip_stale(self._lru))
        assert not self._stale and len(live) == self._num_lru
        self._lru = deque(live)

    def _skip_stale(self, entries: Iterable[int]) -> Iterator[int]:
        """The live ones of LRU entries taken oldest first, using up the stale counts of the
        others (a block's stale entries all come before its live one)."""
        stale = self._stale
        for b in entries:
            n = stale.get(b)
            if n is None:
                yield b
            elif n == 1:
                del stale[b]
            else:
                stale[b] = n - 1

    # prefix caching

    def has_head(self, h: bytes) -> bool:
        """Whether a chain's first hash names a block (a lookup can hit anything)."""
        return h in self._by_hash

    def lookup(self, hashes: list[bytes]) -> list[int]:
        """The blocks of the longest cached prefix of a chain of hashes (nothing is taken)."""
        by_hash = self._by_hash
        if not hashes or hashes[0] not in by_hash:
            return []
        if hashes[0] in self._pending:
            self._name(hashes[0])
        out = []
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
        ref, stale = self._ref, self._stale
        n = 0
        for b in blocks:
            if ref[b] == 0:  # its LRU entry goes stale; freed again, it gets a newer one
                stale[b] = stale.get(b, 0) + 1
                n += 1
            ref[b] += 1
        self._num_lru -= n

    def register(
        self,
        blocks: list[int],
        start: int,
        stop: int,
        hashes: list[bytes],
        tokens: list[int] | None = None,
    ) -> None:
        """blocks[start:stop] of one request, held, full and their KV sent, become reusable.
        `blocks` and `hashes` are the request's own lists, kept as they are, not copied (their
        owner only ever appends to them): blocks[0] is its head, and hashes[i] names block i
        for the hashes known now (at least start of them, and the head's); the blocks past
        those are named by hashing `tokens` (block_size per block) chained on the last known
        hash. Names are given when a lookup finds the head (module docstring). A hash that
        already names another block is left to that one (two requests computed the same prefix
        at once: the second copy stays unnamed). A request that gave back its head registers
        only while the head's hash still names a block (invariant 6)."""
        if not self.caching or stop <= start:
            return
        self._num_reusable += stop - start
        head_block, head_hash = blocks[0], hashes[0]
        if head_hash not in self._by_hash and self._hash[head_block] is None:
            self._by_hash[head_hash] = head_block
            self._hash[head_block] = head_hash
        fragment = (self._clock, blocks, start, stop, hashes, len(hashes), tokens)
        waiting = self._pending.get(head_hash)
        if waiting is None:
            self._pending[head_hash] = [fragment]
        else:
            waiting.append(fragment)

    def register_now(
        self,
        blocks: list[int],
        start: int,
        stop: int,
        hashes: list[bytes],
        token_ids: list[int],
        scope: str,
    ) -> None:
        """`register` with every name given at once and logged (events on): hashes covers at
        least stop blocks, token_ids are blocks[start:stop]'s. A hash that already names
        another block is left to that one, so the events of each run of newly named blocks
        form a chain, and the set the events describe is exactly the set a lookup can hit."""
        if not self.caching or stop <= start:
            return
        assert self.events is not None and len(hashes) >= stop
        self._num_reusable += stop - start
        by_hash, names, bs = self._by_hash, self._hash, self.block_size
        run = -1  # first block of the run being named, -1: none
        for i in range(start, stop + 1):
            b = blocks[i] if i < stop else 0
            if i < stop and names[b] is None and hashes[i] not in by_hash:
                by_hash[hashes[i]] = b
                names[b] = hashes[i]
                if run < 0:
                    run = i
            elif run >= 0:
                tokens = token_ids[(run - start) * bs : (i - start) * bs]
                parent = hashes[run - 1] if run > 0 else None
                self.events.stored(hashes[run:i], parent, tokens, scope)
                run = -1

    def reset(self) -> bool:
        """Forget every cached prefix, if no request holds a block (else False, nothing
        changes): reusable blocks go back empty. Logs AllBlocksCleared."""
        if self.num_free != self.num_usable:
            return False
        self._empty.extend(self._skip_stale(self._lru))
        self._lru.clear()
        self._num_lru = self._num_reusable = 0
        self._hash = [None] * self.num_blocks
        self._by_hash.clear()
        self._pending.clear()
        self._clock += 1
        self._stamp = [self._clock] * self.num_blocks
        if self.events is not None:
            self.events.cleared()
        return True

    def _name(self, head: bytes) -> None:
        """Name the blocks of the fragments waiting under a head that no eviction has handed
        out since they were filed."""
        by_hash, names, stamp = self._by_hash, self._hash, self._stamp
        for clock, blocks, start, stop, hashes, known, tokens in self._pending.pop(head):
            named = hashes[start : min(stop, known)]
            if known < stop:
                named += chain_hashes(hashes[known - 1], tokens, self.block_size)
            for b, h in zip(blocks[start:stop], named, strict=True):
                if stamp[b] <= clock and names[b] is None and h not in by_hash:
                    by_hash[h] = b
                    names[b] = h

    def check(self) -> None:
        """Assert invariants 1 and 5 (tests; walks every block)."""
        empty = set(self._empty)
        assert len(empty) == len(self._empty)
        live, stale = [], dict(self._stale)
        for b in self._lru:  # replay eviction's view of the LRU
            if stale.get(b):
                stale[b] -= 1
            else:
                live.append(b)
        assert not any(stale.values()), "a stale count without its entry"
        assert len(live) == len(set(live)) == self._num_lru
        live = set(live)
        assert all(self._ref[b] == 0 for b in live)
        assert not (empty & live)
        assert 0 not in empty and 0 not in live and self._ref[0] == 0
        for b in range(1, self.num_blocks):
            held = self._ref[b] > 0
            assert held + (b in empty) + (b in live) == 1, f"KV block {b} in two places"
            if b in empty:
                assert self._hash[b] is None, f"KV block {b} is empty and named"
        assert sum(h is not None for h in self._hash) == len(self._by_hash)
        for h, b in self._by_hash.items():
            assert self._hash[b] == h
        assert self._pending.keys() <= self._by_hash.keys(), "fragments wait under a named head"
        assert len(live) <= self._num_reusable <= self.num_usable


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
