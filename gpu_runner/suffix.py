"""The `suffix` drafter's memory: each tenant's recent requests, searched by suffix match.

A drafting request's last tokens (up to MATCH_MAX) are matched against its own tokens and its
tenant's recent requests (prompt and output, one array per request); the longest match wins
(MATCH_ENOUGH tokens are as long as more), the request's own on a tie, within a source the
latest occurrence with k tokens after it, and the tokens after it are the drafts. Drafts are a side channel, like the prefix cache: a tenant's drafts come only from
its own requests, never another tenant's, so nothing about one tenant's text can surface as
speed (or as a token) for another.

Bounds: at most `tenant_tokens` tokens kept per tenant and `total_tokens` over all of them;
past either, the request used least recently (drawn from by a draft, else added) goes first.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

MATCH_MAX = 16  # longest suffix of a request's tokens matched
MATCH_MIN = 2  # shortest match that drafts
MATCH_ENOUGH = 4  # matches this long are as good as longer ones with fewer tokens after them
MAX_CANDIDATES = 512  # the latest places a match may end that are compared: a bounded cost
SEP = -1  # between two requests in a tenant's joined history


def longest_match(history: np.ndarray, tail: np.ndarray, end: int, k: int) -> tuple[int, int]:
    """(length, position) of the longest match of tail's last tokens ending at a position
    below `end` (< len(history)) of history (int64, SEP between requests) that a token of
    the same request follows, among the latest MAX_CANDIDATES places that end with tail's last
    two tokens. Matches of MATCH_ENOUGH tokens count as equal (so a run of one
    token drafts k of it); of the longest ones the latest with k tokens after it before `end`,
    else the earliest (the longest run to copy); (0, -1) when none."""
    cand = np.flatnonzero(history[:end] == tail[-1])  # [C] positions where a match may end
    if len(tail) >= 2:  # why: a common last token has thousands; a match that drafts has 2
        cand = cand[cand >= 1]
        cand = cand[history[cand - 1] == tail[-2]]
    cand = cand[history[cand + 1] != SEP][-MAX_CANDIDATES:]
    if not len(cand):
        return 0, -1
    m = len(tail)
    idx = cand[:, None] - np.arange(m)[None, :]  # [C, m] positions back from each end
    eq = (history[np.maximum(idx, 0)] == tail[::-1][None, :]) & (idx >= 0)
    lengths = np.cumprod(eq, axis=1).sum(1)  # [C] matched tokens
    good = lengths >= min(int(lengths.max()), MATCH_ENOUGH)
    tied, tied_lengths = cand[good], lengths[good]
    room = np.flatnonzero(tied + k < end)
    j = int(room[-1]) if len(room) else 0
    return int(tied_lengths[j]), int(tied[j])


def continuation(history: np.ndarray, at: int, k: int) -> list[int]:
    """Up to k tokens after position at, stopping at the end of its request."""
    after = history[at + 1 : at + 1 + k]
    cut = np.flatnonzero(after == SEP)
    return (after[: cut[0]] if len(cut) else after).tolist()


class TenantHistory:
    """One tenant's recent requests, oldest first, and their tokens joined by SEP."""

    def __init__(self) -> None:
        self.docs: OrderedDict[int, np.ndarray] = OrderedDict()  # request number -> tokens
        self.used: dict[int, int] = {}  # request number -> clock of its last use
        self.num_tokens = 0
        self._joined: np.ndarray | None = None  # [N] int64, rebuilt after a change
        self._starts = np.zeros(0, np.int64)  # [D] where each request starts in _joined
        self._keys: list[int] = []

    def add(self, key: int, tokens: np.ndarray, clock: int) -> None:
        self.docs[key] = tokens
        self.used[key] = clock
        self.num_tokens += len(tokens)
        self._joined = None

    def drop_lru(self) -> int:
        """Forget the request used least recently; the tokens freed."""
        key = min(self.used, key=self.used.__getitem__)
        del self.used[key]
        n = len(self.docs.pop(key))
        self.num_tokens -= n
        self._joined = None
        return n

    def oldest_use(self) -> int:
        return min(self.used.values())

    def joined(self) -> np.ndarray:
        if self._joined is None:
            docs = list(self.docs.values())
            self._keys = list(self.docs)
            lengths = np.asarray([len(d) + 1 for d in docs], np.int64)
            self._starts = np.cumsum(lengths) - lengths
            sep = np.full(1, SEP, np.int64)
            self._joined = np.concatenate([p for d in docs for p in (d, sep)] or [sep])
        return self._joined

    def touch(self, at: int, clock: int) -> None:
        """The request holding joined position `at` was drawn from."""
        j = int(np.searchsorted(self._starts, at, side="right")) - 1
        self.used[self._keys[j]] = clock


class SuffixIndex:
    """Every tenant's TenantHistory, bounded per tenant and in all."""

    def __init__(self, tenant_tokens: int = 1 << 16, total_tokens: int = 1 << 20) -> None:
        assert 0 < tenant_tokens <= total_tokens
        self.tenant_tokens = tenant_tokens
        self.total_tokens = total_tokens
        self.tenants: dict[str, TenantHistory] = {}
        self.num_tokens = 0
        self._clock = 0
        self._num_docs = 0

    def add(self, tenant: str, tokens: list[int]) -> None:
        """A request of this tenant ended: its tokens (the last tenant_tokens of them) join
        the tenant's history; the least recently used requests leave past the bounds."""
        if len(tokens) <= MATCH_MIN:
            return
        arr = np.asarray(tokens[-self.tenant_tokens :], np.int64)
        hist = self.tenants.setdefault(tenant, TenantHistory())
        self._clock += 1
        self._num_docs += 1
        hist.add(self._num_docs, arr, self._clock)
        self.num_tokens += len(arr)
        while hist.num_tokens > self.tenant_tokens:
            self.num_tokens -= hist.drop_lru()
        while self.num_tokens > self.total_tokens:
            kept = [h for h in self.tenants.values() if h.docs]
            oldest = min(kept, key=TenantHistory.oldest_use)
            self.num_tokens -= oldest.drop_lru()
        for name in [t for t, h in self.tenants.items() if not h.docs]:
            del self.tenants[name]

    def propose(self, tenant: str, own: list[int], k: int) -> list[int]:
        """Up to k drafts after own (a request's tokens so far), from its own tokens or its
        tenant's history, whichever matches longer (its own on a tie)."""
        if len(own) < MATCH_MIN or k <= 0:
            return []
        mine = np.asarray(own, np.int64)
        tail = mine[-MATCH_MAX:]
        n, at = longest_match(mine, tail, len(mine) - 1, k)
        hist = self.tenants.get(tenant)
        if hist is not None:
            joined = hist.joined()
            n_t, at_t = longest_match(joined, tail, len(joined) - 1, k)
            if n_t > n and n_t >= MATCH_MIN:
                self._clock += 1
                hist.touch(at_t, self._clock)
                return continuation(joined, at_t, k)
        return continuation(mine, at, k) if n >= MATCH_MIN else []
