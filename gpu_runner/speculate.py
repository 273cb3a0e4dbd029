"""Drafts for speculative decoding, kept per slot on the host.

A drafting slot keeps its tokens (prompt, then outputs as they are sampled) and, for OpenAI's
Predicted Outputs, the predicted ids with the index of the one expected next. The core plans
only how many drafts a row may verify (StepPlan.num_draft); which ids they are is decided here
when the step is prepared, from everything the runner has sampled so far, so a step planned
while the previous one was in flight never needs ids the core has not seen.

- `ngram` (prompt lookup): the last n tokens (n = NGRAM_MAX down to NGRAM_MIN) are looked up
  in the slot's earlier tokens; the tokens after the latest match are the drafts.
- `suffix`: the slot's last tokens matched against its own tokens and its tenant's recent
  requests (gpu_runner/suffix.py); a slot that leaves adds its tokens to its tenant's history.
- `prediction`: the predicted ids after the last one the output matched; after a mismatch the
  output's last tokens are looked up in the prediction to re-align (longest match first, the
  earliest one after where it was).

- `draft`: a draft model run by the runner (gpu_runner/draft_model.py), batched over the
  drafting rows; this keeps its slots' tokens.

A head reading the target's hidden states (EAGLE, MTP) would be another method here, its
drafts made by the device after the forward instead of on the host before it.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from gapless.gpu_runner.suffix import SuffixIndex

NGRAM_MAX, NGRAM_MIN = 3, 2  # lengths of the n-gram looked up, longest first
REALIGN_MAX = 4  # longest output suffix looked up in a prediction after a mismatch


def ngram_lookup(tokens: list[int], k: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of tokens' last n tokens."""
    if len(tokens) <= NGRAM_MIN:
        return []
    h = np.asarray(tokens, np.int64)
    for n in range(min(NGRAM_MAX, len(h) - 1), NGRAM_MIN - 1, -1):
        windows = sliding_window_view(h[:-1], n)  # [len - n, n]: none is the suffix itself
        hits = np.flatnonzero((windows == h[-n:]).all(1))
        if len(hits):
            at = int(hits[-1]) + n
            return h[at : at + k].tolist()
    return []


class Drafts:
    def __init__(self, num_slots: int, suffix: SuffixIndex | None = None) -> None:
        self.suffix = SuffixIndex() if suffix is None else suffix
        self.method = [""] * num_slots  # "" for a slot that does not draft
        self.tenant = [""] * num_slots  # whose history a suffix slot drafts from and joins
        self.active = np.zeros(num_slots, bool)  # [slots] drafting
        self.tokens: list[list[int]] = [[] for _ in range(num_slots)]  # prompt, then outputs
        self.prediction: list[list[int]] = [[] for _ in range(num_slots)]
        self.next: list[int] = [0] * num_slots  # prediction index expected next; -1: lost
        self.last_match = [0] * num_slots  # where the prediction last matched

    def add(
        self, slot: int, method: str, prediction: list[int], cached: list[int], tenant: str = ""
    ) -> None:
        self.method[slot] = method
        self.tenant[slot] = tenant
        self.active[slot] = bool(method)
        self.tokens[slot] = list(cached)
        self.prediction[slot] = prediction
        # why -1 when cached or recomputing: outputs may be among the tokens; re-align
        self.next[slot] = -1 if cached else 0
        self.last_match[slot] = 0

    def remove(self, slot: int) -> None:
        if self.method[slot] == "suffix":
            self.suffix.add(self.tenant[slot], self.tokens[slot])
        self.method[slot] = ""
        self.active[slot] = False
        self.tokens[slot] = []
        self.prediction[slot] = []

    def any_in(self, slots: np.ndarray) -> bool:
        return bool(self.active[slots].any())

    def fed(self, slot: int, ids: list[int]) -> None:
        """Tokens the plan fed (a prompt chunk, a recompute): known, not predicted."""
        self.tokens[slot].extend(ids)
        if self.prediction[slot]:
            self.next[slot] = -1

    def sampled(self, slot: int, ids: list[int]) -> None:
        """Output tokens of a step, in order."""
        self.tokens[slot].extend(ids)
        pred = self.prediction[slot]
        if not pred:
            return
        at = self.next[slot]
        for t in ids:
            if 0 <= at < len(pred) and pred[at] == t:
                at += 1
                self.last_match[slot] = at
            else:
                at = -1
        self.next[slot] = at

    def propose(self, slot: int, k: int) -> list[int]:
        """Up to k drafts to verify after the slot's last token."""
        if self.method[slot] == "prediction":
            at = self.next[slot]
            if at < 0:
                at = self.next[slot] = self._realign(slot)
            return self.prediction[slot][at : at + k] if at >= 0 else []
        if self.method[slot] == "suffix":
            return self.suffix.propose(self.tenant[slot], self.tokens[slot], k)
        if self.method[slot] == "draft":  # the runner's draft model (gpu_runner/draft_model.py)
            return []
        return ngram_lookup(self.tokens[slot], k)

    def _realign(self, slot: int) -> int:
        """The prediction index after the longest match of the last tokens, or -1."""
        pred, tokens = self.prediction[slot], self.tokens[slot]
        if not pred or not tokens:
            return -1
        p = np.asarray(pred, np.int64)
        for n in range(min(REALIGN_MAX, len(tokens), len(p)), 0, -1):
            tail = np.asarray(tokens[-n:], np.int64)
            hits = np.flatnonzero((sliding_window_view(p, n) == tail).all(1)) + n
            if len(hits):
                later = hits[hits >= self.last_match[slot]]
                return int(later[0] if len(later) else hits[-1])
        return -1
