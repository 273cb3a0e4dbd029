"""Which engine replica a request goes to (--data-parallel-size), as one frontend sees them.

A request goes to the replica with the least work before it: the prompt tokens waiting there,
less the prefix of this prompt that replica holds in its cache; on a tie, the one holding more
of it, then the one with fewer of this frontend's requests in flight, then the next in turn.
The waiting tokens are this frontend's own, exact (what it sent there that has not started),
plus the other frontends' from that replica's latest QueueState. What a replica holds is what
this frontend sent it: the block hashes of the prompts it routed there (AddRequest.block_hashes,
named in the request's cache scope, so one tenant's prompts never steer another's), the most
recent MAX_BLOCKS per replica. The replica may have evicted some since; then the request
computes them, as it would anywhere.
"""

from __future__ import annotations

from collections import OrderedDict

from prometheus_client import CollectorRegistry, Counter

from gapless.common.messages import QueueState

# block hashes remembered per replica (~100 bytes each): 2**16 blocks of 16 tokens is 1M
# tokens of prompts, more KV than a replica caches
MAX_BLOCKS = 2**16


def routed_counter(registry: CollectorRegistry | None = None) -> Counter:
    """`gapless_routed_requests_total{replica,reason}`: requests each frontend sent to each
    replica, because a prefix of the prompt is held there ("prefix") or by load alone
    ("load")."""
    return Counter(
        "gapless_routed_requests",
        "Requests sent to each engine replica, by what chose it",
        ["replica", "reason"],
        registry=registry,
    )


class ReplicaRouter:
    """Per-replica load and held prefixes; O(replicas × prompt blocks) per request."""

    def __init__(
        self, num_replicas: int, frontend_id: int, block_size: int, routed: Counter | None = None
    ) -> None:
        self.num_replicas = num_replicas
        self.frontend_id = frontend_id
        self.block_size = block_size
        self._mine = [0] * num_replicas  # prompt tokens sent there, not started
        self._others = [0] * num_replicas  # the other frontends' waiting tokens there
        self._inflight = [0] * num_replicas  # requests sent there, not yet ended
        self._held: list[OrderedDict[bytes, None]] = [OrderedDict() for _ in range(num_replicas)]
        self._turn = 0
        self._routed = routed

    def choose(self, hashes: list[bytes]) -> int:
        """The replica for a request whose prompt's full blocks are named `hashes`."""
        n = self.num_replicas
        if n == 1:
            return 0
        best, best_key, best_cached = 0, None, 0
        for i in range(n):
            r = (self._turn + i) % n
            cached = self._held_tokens(r, hashes)
            key = (self._mine[r] + self._others[r] - cached, -cached, self._inflight[r])
            if best_key is None or key < best_key:
                best, best_key, best_cached = r, key, cached
        self._turn = (self._turn + 1) % n
        if self._routed is not None:
            self._routed.labels(str(best), "prefix" if best_cached else "load").inc()
        return best

    def _held_tokens(self, replica: int, hashes: list[bytes]) -> int:
        held, num = self._held[replica], 0
        for h in hashes:
            if h not in held:
                break
            num += 1
        return num * self.block_size

    def add(self, replica: int, hashes: list[bytes], num_tokens: int) -> None:
        """An engine request of num_tokens prompt tokens went to `replica`."""
        self._inflight[replica] += 1
        self._mine[replica] += num_tokens
        held = self._held[replica]
        for h in hashes:
            if h in held:
                held.move_to_end(h)
            else:
                held[h] = None
        while len(held) > MAX_BLOCKS:
            held.popitem(last=False)

    def leave(self, replica: int, num_tokens: int) -> None:
        """One engine request sent there started, or ended before it did."""
        self._mine[replica] = max(0, self._mine[replica] - num_tokens)

    def ended(self, replica: int) -> None:
        """An engine request sent there ended (leave() first if it never started)."""
        self._inflight[replica] = max(0, self._inflight[replica] - 1)

    def update(self, state: QueueState) -> None:
        r = state.replica
        if not 0 <= r < self.num_replicas:
            return
        me = self.frontend_id
        tokens = state.waiting_tokens
        self._others[r] = sum(tokens) - (tokens[me] if me < len(tokens) else 0)
