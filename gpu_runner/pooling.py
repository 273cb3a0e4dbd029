"""Pooled hidden states of embedding requests (SamplingParams.pooling), kept per slot.

A pooling slot's prompt runs in chunks like any prompt. Each step keeps the final hidden
state (after the final norm, before the output layer) of the rows its pooling needs: every
prompt row for "mean" (summed here, divided by the prompt length at the end), the first for
"cls", the last prompt row for "last". The vector is read when the slot samples its one token,
which is after its prompt's last chunk. A preempted slot is freed and added again, so a
recompute starts from zero; no prefix-cache hit skips a row (core/prefix.py).
"""

from __future__ import annotations

import numpy as np
import torch

from gapless.common.messages import StepPlan

KINDS = {"last": 1, "mean": 2, "cls": 3}
LAST, MEAN, CLS = 1, 2, 3


class Pooler:
    def __init__(self, max_slots: int, hidden_size: int, device: torch.device) -> None:
        self.kind = np.zeros(max_slots, dtype=np.int8)  # [slots] 0: not pooling, else KINDS
        self.num_prompt = np.zeros(max_slots, dtype=np.int64)  # [slots]
        self.num_active = 0
        # [slots, hidden] float32, on device: each pooling slot's sum or kept row
        self.acc = torch.zeros(max_slots, hidden_size, dtype=torch.float32, device=device)
        self.device = device

    def add(self, slot: int, pooling: str | None, num_prompt: int) -> None:
        if pooling is None:
            return
        self.kind[slot] = KINDS[pooling]
        self.num_prompt[slot] = num_prompt
        self.acc[slot].zero_()
        self.num_active += 1

    def remove(self, slot: int) -> None:
        if self.kind[slot]:
            self.kind[slot] = 0
            self.num_active -= 1

    def in_plan(self, plan: StepPlan) -> bool:
        """Whether a pooling slot is among the plan's entries."""
        return bool(self.num_active) and bool(self.kind[plan.slots].any())

    def rows(self, plan: StepPlan) -> tuple[np.ndarray, np.ndarray]:
        """([K] rows of the step's tokens whose hidden state is kept, [K] their slots), in
        row order; the step runs unpadded, one row per query token in entry order."""
        slots = np.asarray(plan.slots, dtype=np.int64)  # [B]
        n = np.asarray(plan.num_tokens, dtype=np.int64)  # [B]
        ends = np.cumsum(n)
        entry = np.repeat(np.arange(len(slots)), n)  # [T]
        positions = np.asarray(plan.start_pos, dtype=np.int64)[entry] + np.arange(int(ends[-1]))
        positions -= (ends - n)[entry]
        tok_slot = slots[entry]
        kind, last = self.kind[tok_slot], self.num_prompt[tok_slot] - 1
        keep = (
            ((kind == MEAN) & (positions <= last))
            | ((kind == CLS) & (positions == 0))
            | ((kind == LAST) & (positions == last))
        )
        rows = np.flatnonzero(keep)
        return rows, tok_slot[rows]

    def accumulate(self, hidden: torch.Tensor, slots: np.ndarray) -> None:
        """hidden [K, hidden] float32: the kept rows' states, of slots [K]. A "cls" or "last"
        slot gets one row in its life, so adding it to its zeroed row keeps it."""
        index = torch.from_numpy(slots).to(self.device, non_blocking=True)
        self.acc.index_add_(0, index, hidden)

    def take(self, sample_slots: np.ndarray) -> tuple[torch.Tensor, np.ndarray] | None:
        """([P, hidden] float32 on device, [P] which sampled rows they are) for the sampled
        rows that pool; None when none does. A copy: later steps may reuse the slots."""
        if not self.num_active:
            return None
        kind = self.kind[sample_slots]
        picked = np.flatnonzero(kind)
        if not len(picked):
            return None
        slots = sample_slots[picked]
        divisor = np.where(kind[picked] == MEAN, self.num_prompt[slots], 1).astype(np.float32)
        index = torch.from_numpy(slots).to(self.device)
        scale = torch.from_numpy(divisor).to(self.device)[:, None]
        return self.acc.index_select(0, index) / scale, picked


def embedding_bytes(
    vectors: torch.Tensor | None, picked: np.ndarray | None, num_sampled: int
) -> list[bytes]:
    """StepResult.embeddings: per sampled row, its vector as little-endian float32 bytes, b""
    for rows that do not pool; [] when none does. Waits for the vectors on the device."""
    if vectors is None or picked is None:
        return []
    host = vectors.cpu().numpy().astype("<f4", copy=False)
    out = [b""] * num_sampled
    for j, row in zip(picked.tolist(), host, strict=True):
        out[j] = row.tobytes()
    return out
