"""The persistent batch: per-slot state kept across steps, and a step's inputs built from it.

Host-side mirrors are numpy; everything per token is computed with array ops over the plan.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from core.messages import StepPlan
from gpu_runner.attention import AttnMetadata, PrefillSeq


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long
    meta: AttnMetadata
    logit_rows: torch.Tensor  # [B_s] long: last row of each sampling entry
    sample_slots: torch.Tensor  # [B_s] long
    sample_slots_host: np.ndarray  # [B_s] int64, the same on the host
    sample_positions: torch.Tensor  # [B_s] long: position the sampled token will take
    fed_slots: torch.Tensor  # [F] long: slot of each host-fed token (penalty bookkeeping)
    fed_slots_host: np.ndarray  # [F] int64
    fed_positions: torch.Tensor  # [F] long
    fed_ids: torch.Tensor  # [F] long
    num_tokens: int


class PersistentBatch:
    def __init__(self, max_slots: int, max_blocks_per_seq: int, block_size: int, device) -> None:
        self.block_size = block_size
        self.device = device
        self.block_table = np.zeros((max_slots, max_blocks_per_seq), dtype=np.int64)
        self.num_blocks = np.zeros(max_slots, dtype=np.int64)
        self.active = np.zeros(max_slots, dtype=bool)
        # [max_slots] long, on device: the token each slot sampled last
        self.last_token = torch.zeros(max_slots, dtype=torch.long, device=device)

    def add(self, slot: int) -> None:
        assert not self.active[slot], f"slot {slot} added twice"
        self.active[slot] = True
        self.num_blocks[slot] = 0

    def remove(self, slot: int) -> None:
        assert self.active[slot], f"slot {slot} freed while not in use"
        self.active[slot] = False

    def prepare(self, plan: StepPlan) -> StepInputs:
        bs = self.block_size
        slots = np.asarray(plan.slots, dtype=np.int64)  # [B]
        n = np.asarray(plan.num_tokens, dtype=np.int64)  # [B]
        start = np.asarray(plan.start_pos, dtype=np.int64)  # [B]
        has_tokens = np.asarray(plan.has_tokens, dtype=bool)
        sample = np.asarray(plan.sample, dtype=bool)
        assert self.active[slots].all(), "plan schedules a slot that is not in use"

        # block tables: append each entry's new blocks after the ones the slot already has
        nb = np.asarray(plan.num_new_blocks, dtype=np.int64)
        if nb.any():
            rows = np.repeat(slots, nb)
            offs = np.arange(nb.sum()) - np.repeat(np.cumsum(nb) - nb, nb)
            self.block_table[rows, self.num_blocks[rows] + offs] = plan.new_blocks
            np.add.at(self.num_blocks, slots, nb)

        # per token: entry, position, cache row
        t = int(n.sum())
        ends = np.cumsum(n)
        entry = np.repeat(np.arange(len(n)), n)  # [T]
        positions = start[entry] + np.arange(t) - (ends - n)[entry]
        tok_slot = slots[entry]
        slot_mapping = self.block_table[tok_slot, positions // bs] * bs + positions % bs

        # ids: carried by the plan, or read from last_token on the device
        fed = has_tokens[entry]
        input_ids = torch.empty(t, dtype=torch.long, device=self.device)
        fed_ids = torch.as_tensor(np.asarray(plan.token_ids, dtype=np.int64), device=self.device)
        fed_rows = np.flatnonzero(fed)
        if len(fed_rows) == t:
            input_ids.copy_(fed_ids)
        else:
            input_ids[torch.as_tensor(fed_rows)] = fed_ids
            dev_rows = np.flatnonzero(~fed)
            input_ids[torch.as_tensor(dev_rows)] = self.last_token[
                torch.as_tensor(tok_slot[dev_rows])
            ]

        ctx_len = start + n
        single = np.flatnonzero(n == 1)
        meta = AttnMetadata(
            slot_mapping=torch.as_tensor(slot_mapping, device=self.device),
            decode_rows=torch.as_tensor(ends[single] - 1, device=self.device),
            decode_kv_rows=torch.empty(0, dtype=torch.long),
            decode_mask=torch.empty(0, dtype=torch.bool),
            prefills=[],
        )
        if len(single):
            lmax = int(ctx_len[single].max())
            pos = np.arange(lmax)
            mask = pos[None, :] < ctx_len[single][:, None]  # [D, L]
            rows = self.block_table[slots[single][:, None], pos[None, :] // bs] * bs + pos % bs
            meta.decode_kv_rows = torch.as_tensor(np.where(mask, rows, 0), device=self.device)
            meta.decode_mask = torch.as_tensor(mask[:, None, None, :], device=self.device)
        for j in np.flatnonzero(n > 1):
            ctx = int(ctx_len[j])
            pos = np.arange(ctx)
            rows = self.block_table[slots[j], pos // bs] * bs + pos % bs
            q_pos = start[j] + np.arange(n[j])
            mask = pos[None, :] <= q_pos[:, None]  # causal over the cached prefix
            meta.prefills.append(
                PrefillSeq(
                    token_start=int(ends[j] - n[j]),
                    num_tokens=int(n[j]),
                    kv_rows=torch.as_tensor(rows, device=self.device),
                    mask=torch.as_tensor(mask[None, None], device=self.device),
                )
            )
        return StepInputs(
            input_ids=input_ids,
            positions=torch.as_tensor(positions, device=self.device),
            meta=meta,
            logit_rows=torch.as_tensor(ends[sample] - 1, device=self.device),
            sample_slots=torch.as_tensor(slots[sample], device=self.device),
            sample_slots_host=slots[sample],
            sample_positions=torch.as_tensor(ctx_len[sample], device=self.device),
            fed_slots=torch.as_tensor(tok_slot[fed_rows], device=self.device),
            fed_slots_host=tok_slot[fed_rows],
            fed_positions=torch.as_tensor(positions[fed_rows], device=self.device),
            fed_ids=fed_ids,
            num_tokens=t,
        )
