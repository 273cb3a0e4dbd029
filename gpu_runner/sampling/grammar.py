"""Grammar-constrained rows: one llguidance matcher per constrained slot, and the token bitmask
applied to those rows only, before sampling.

The pipeline (docs/architecture.md, "Constrained decoding"): the forward of step n+1 does not
need the mask, only sampling does. So the runner launches n+1 as usual; at its sampling it
waits for the ids of step n of the constrained rows alone (a small copy to host started right
after step n's sampling), advances their matchers, fills their masks and applies them. Rows
without a grammar are never touched, and a batch without one costs one numpy lookup.
"""

from __future__ import annotations

from collections import OrderedDict

import llguidance
import llguidance.numpy as llg_np
import numpy as np
import torch

from gapless.common.grammars import make_tokenizer, parser_limits
from gapless.common.messages import StepPlan

MAX_CACHED = 64  # compiled grammars kept, least recently used dropped first


class GrammarCache:
    """Pristine matchers by grammar text, so a repeated schema is compiled once; size-capped."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, max_entries: int = MAX_CACHED) -> None:
        self.tokenizer = tokenizer
        self.max_entries = max_entries
        self._cache: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()

    def matcher(self, grammar: str) -> llguidance.LLMatcher:
        """A fresh matcher at the grammar's start (check is_error: a bad grammar is an error
        state, never an exception)."""
        pristine = self._cache.get(grammar)
        if pristine is None:
            pristine = llguidance.LLMatcher(
                self.tokenizer, grammar, log_level=0, limits=parser_limits()
            )
            self._cache[grammar] = pristine
            if len(self._cache) > self.max_entries:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(grammar)
        return pristine.deep_copy()


class GrammarRows:
    """Contract with the runner: `add`/`remove` with slots; `feed` every token a plan carries
    (a recompute after preemption feeds the outputs again); `remember` the sampled ids after
    each sampling; `apply` to the logits before sampling."""

    def __init__(
        self,
        tokenizer_json: str,
        vocab_size: int,
        eos: tuple[int, ...],
        max_slots: int,
        device: torch.device,
    ) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self._eos = list(eos)
        # why at start: building it inside a step would stall every row of that step
        self.cache = GrammarCache(make_tokenizer(tokenizer_json, vocab_size, tuple(eos)))
        self._matchers: dict[int, llguidance.LLMatcher] = {}
        self._num_prompt = np.zeros(max_slots, np.int64)
        self._fed_until = np.zeros(max_slots, np.int64)  # positions below this are consumed
        self.constrained = np.zeros(max_slots, bool)
        self._pending: tuple[np.ndarray, torch.Tensor, np.ndarray] | None = None
        # [S, W] int32, W = ceil(V / 32), all allowed; llguidance's torch helpers are not used:
        # importing them loads torch's compiler stack into every runner at start
        self._host_mask = torch.full(llg_np.get_bitmask_shape(max_slots, vocab_size), -1,
                                     dtype=torch.int32)  # fmt: skip
        if device.type == "cuda":
            self._host_mask = self._host_mask.pin_memory()

    def add(self, slot: int, grammar: str | None, num_prompt: int) -> None:
        self.remove(slot)
        if grammar is None:
            return
        self._matchers[slot] = self.cache.matcher(grammar)
        self._num_prompt[slot] = num_prompt
        self._fed_until[slot] = num_prompt
        self.constrained[slot] = True

    def remove(self, slot: int) -> None:
        if slot in self._matchers:
            self._catch_up()  # why: ids still pending for the slot belong to this matcher
        self._matchers.pop(slot, None)
        self.constrained[slot] = False

    def any_in(self, host_slots: np.ndarray) -> bool:
        return bool(self._matchers) and bool(self.constrained[host_slots].any())

    def feed_plan(self, plan: StepPlan) -> None:
        """Constrained slots' outputs carried by a plan (a recompute) go to their matchers."""
        if not self._matchers:
            return
        slots = np.asarray(plan.slots, np.int64)
        if not self.any_in(slots):
            return
        has = np.asarray(plan.has_tokens, bool)
        n = np.asarray(plan.num_tokens, np.int64)[has]
        entry = np.repeat(np.arange(len(n)), n)
        offsets = np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)
        positions = np.asarray(plan.start_pos, np.int64)[has][entry] + offsets
        self.feed(slots[has][entry], positions, plan.token_ids)

    def feed(self, host_slots: np.ndarray, positions: np.ndarray, ids: list[int]) -> None:
        """Outputs a plan feeds again (a recompute): consumed in order, once."""
        if not self.any_in(host_slots):
            return
        for slot, pos, token in zip(host_slots.tolist(), positions.tolist(), ids, strict=True):
            if self.constrained[slot] and pos == self._fed_until[slot]:
                self._matchers[slot].consume_token(token)
                self._fed_until[slot] += 1

    def remember(self, host_slots: np.ndarray, token_ids: torch.Tensor) -> None:
        """After sampling: start copying the constrained rows' ids to the host; the next
        `apply` consumes them (on cuda, waiting only for that copy)."""
        rows = np.flatnonzero(self.constrained[host_slots])
        if not len(rows):
            return
        index = torch.from_numpy(rows).to(token_ids.device)
        done = None
        if token_ids.device.type == "cuda":
            # why pinned: a copy into pageable memory would wait for the step here, at launch
            ids = torch.empty(len(rows), dtype=token_ids.dtype, pin_memory=True)
            ids.copy_(token_ids[index], non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        else:
            ids = token_ids[index]
        self._catch_up()
        self._pending = (host_slots[rows], ids, np.asarray([done]))

    def _catch_up(self) -> None:
        """Consume the ids of the last sampling of constrained rows."""
        if self._pending is None:
            return
        slots, ids, (done,) = self._pending
        self._pending = None
        if done is not None:
            done.synchronize()
        for slot, token in zip(slots.tolist(), ids.tolist(), strict=True):
            matcher = self._matchers.get(slot)
            if matcher is not None:  # None: freed since
                matcher.consume_token(token)
                self._fed_until[slot] += 1

    def apply(
        self, logits: torch.Tensor, host_slots: np.ndarray, inplace: bool = False
    ) -> torch.Tensor:
        """logits [B, V] float32 with each constrained row limited to what its grammar allows
        next (changed in place when `inplace`, else a copy if any row is constrained). A matcher in an error state allows only EOS,
        so the request ends instead of sampling garbage."""
        rows = np.flatnonzero(self.constrained[host_slots])
        if not len(rows):
            return logits
        self._catch_up()
        masks = self._host_mask[: len(rows)]
        host_masks = masks.numpy()  # the same memory
        for i, slot in enumerate(host_slots[rows].tolist()):
            matcher = self._matchers[slot]
            if matcher.is_error():
                masks[i].zero_()
                for eos in self._eos:
                    masks[i, eos // 32] |= 1 << (eos % 32)
            else:
                llg_np.fill_next_token_bitmask(matcher, host_masks, i)
        # why numpy: unpacking R x V bits is microseconds single-threaded, where a chain of
        # small torch ops costs a thread-pool round trip each on a busy CPU
        bits = np.unpackbits(masks.numpy().view(np.uint8), axis=1, bitorder="little")
        banned = torch.from_numpy(bits[:, : logits.shape[1]] == 0)  # [R, V] bool
        banned = banned.to(logits.device, non_blocking=True)
        x = logits if inplace else logits.clone()
        for i, row in enumerate(rows.tolist()):
            x[row].masked_fill_(banned[i], -torch.inf)
        return x
