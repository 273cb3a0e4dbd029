"""The scheduler's side of prefix caching: which blocks a request taking a seat may reuse, and
when a running request's blocks are offered to the cache.

Invariants (core/kv_blocks.py): a request taking a seat takes the longest cached chain of its
tokens and starts computing at the first token past it. A running request is filed under its
first block's hash; a lookup of the same first block registers (offers to the cache) the
blocks that its steps already planned have filled, so a request sharing a prefix with one
still running finds it, and never a block that the step being planned writes. The rest of its
full blocks with known ids are registered when it leaves its slot (finished or preempted), so
a preempted request usually finds its own KV again, and those a sliding window leaves behind
just before they go back (core/window.py). An embedding request (SamplingParams.pooling) takes
nothing from the cache and offers nothing to it: its mean or first-token pooling must see every
prompt token computed, and its KV is not wanted after it. The allocator names registered blocks
only when a lookup asks, so distinct prompts pay one probe per lookup and one registration per
request for the cache.
"""

from __future__ import annotations

from gapless.core.kv_blocks import BlockManager, chain_hashes, hash_root
from gapless.core.request import Request
from gapless.core.running import RunningBatch


class PrefixCache:
    def __init__(
        self, blocks: BlockManager, rb: RunningBatch, enabled: bool, model_salt: str
    ) -> None:
        self.blocks = blocks
        self.rb = rb
        self.enabled = enabled
        self._model_salt = model_salt
        self._roots: dict[str, bytes] = {}  # cache salt -> hash root
        # running requests by their first block's hash: a lookup of it registers their blocks
        self._running_heads: dict[bytes, list[Request]] = {}
        # over every admission (a recompute after preemption included)
        self.num_queried_tokens = 0  # tokens looked up
        self.num_hit_tokens = 0  # of which found cached

    def lookup(self, req: Request) -> list[int]:
        """Blocks of the longest cached prefix a request may take: at most (tokens - 1) //
        block size, so that it computes at least its last token (kv_blocks invariant 4)."""
        bs = self.blocks.block_size
        hashes = req.block_hashes
        if hashes:
            head = hashes[0]
        elif req.num_tokens > bs:
            # why the first block alone first: a miss there (the common case with no sharing)
            # then costs one sha256, not the whole prompt's hashing
            head = self.hashes(req, 1)[0]
        else:
            return []
        running = self._running_heads.get(head)
        if running is not None:
            rb = self.rb
            for peer in running:
                self.offer(peer, int(rb.computed[peer.slot]), int(rb.num_freed[peer.slot]))
        if not self.blocks.has_head(head):  # with the frontend's hashes: one dict probe
            return []
        max_blocks = (req.num_tokens - 1) // bs
        return self.blocks.lookup(self.hashes(req, max_blocks)[:max_blocks])

    def record(self, num_tokens: int, num_cached: int) -> None:
        """A request took a seat with num_tokens, num_cached of them found cached."""
        self.num_queried_tokens += num_tokens
        self.num_hit_tokens += num_cached

    def file_running(self, req: Request) -> None:
        """req took a seat: file it under its first block's hash, if known."""
        if req.block_hashes and self.enabled:
            req.head_hash = head = req.block_hashes[0]
            peers = self._running_heads.get(head)
            if peers is None:
                self._running_heads[head] = [req]
            else:
                peers.append(req)

    def leave(self, req: Request, computed: int, num_freed: int = 0) -> None:
        """req leaves its slot having computed this many tokens and given back its first
        num_freed blocks (out of a window): unfile it and register its full blocks."""
        if not self.enabled:
            return
        if req.head_hash is not None:
            peers = self._running_heads[req.head_hash]
            if len(peers) == 1:
                del self._running_heads[req.head_hash]
            else:
                peers.remove(req)
            req.head_hash = None
        self.offer(req, computed, num_freed)

    def keeps(self, req: Request, num_freed: int) -> bool:
        """Whether a request that gave back its first num_freed blocks may still register
        more (kv_blocks invariant 6): none of those went back unregistered, and its head, if
        given back, is still named (register names the head it is handed, which by then may
        hold another request's KV)."""
        if not self.enabled or num_freed > req.num_named:
            return False
        return num_freed == 0 or self.blocks.has_head(req.block_hashes[0])

    def takes(self, req: Request) -> bool:
        """Whether req may take blocks from the cache and offer its own: not an embedding."""
        return self.enabled and req.params.pooling is None

    def offer(self, req: Request, computed: int, num_freed: int = 0) -> None:
        """Register a request's full blocks that the steps planned so far (all sent), having
        computed this many tokens, have filled and whose ids are known, past those it
        registered before; nothing once its chain has lost a block (`keeps`). Those the
        frontend's prompt hashes cover go with their hashes; the rest (outputs) with their
        tokens, hashed only if a lookup ever asks (kv_blocks: lazy names)."""
        if req.params.pooling is not None or (num_freed and not self.keeps(req, num_freed)):
            return
        bs = self.blocks.block_size
        known = min(computed, req.num_prompt + req.num_outputs)
        first, last = req.num_named, min(known // bs, len(req.blocks))
        if last <= first:
            return
        if self.blocks.events is not None:  # named now, each name logged for routers
            tokens = req.known_tokens(first * bs, last * bs)
            hashes = self.hashes(req, last)
            self.blocks.register_now(req.blocks, first, last, hashes, tokens, req.cache_salt)
            req.num_named = last
            return
        hashes = req.block_hashes
        if len(hashes) < max(first, 1):  # rare: no frontend hashes, or outputs registered before
            hashes = self.hashes(req, max(first, 1))
        k = len(hashes)
        tokens = req.known_tokens(k * bs, last * bs) if k < last else None
        self.blocks.register(req.blocks, first, last, hashes, tokens)
        req.num_named = last

    def hashes(self, req: Request, n: int) -> list[bytes]:
        """The request's chained block hashes, computed once each, at least n of them (the
        ids of its first n blocks must be known)."""
        hashes = req.block_hashes
        if len(hashes) < n:
            bs = self.blocks.block_size
            if hashes:
                parent = hashes[-1]
            else:
                parent = self._roots.get(req.cache_salt) or self._root(req.cache_salt)
            hashes.extend(chain_hashes(parent, req.known_tokens(len(hashes) * bs, n * bs), bs))
        return hashes

    def _root(self, scope: str) -> bytes:
        """The hash root of a cache scope (AddRequest.cache_salt: the frontend's
        block_hash.cache_scope of tenant and salt), kept for the scopes seen lately."""
        roots = self._roots
        if len(roots) >= 4096:  # why a bound: tenants and salts are the clients' to choose
            roots.clear()
        root = roots[scope] = hash_root(self._model_salt, scope)
        return root
