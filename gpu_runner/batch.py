"""The persistent batch: per-slot state kept across steps, and a step's inputs built from it.

Host-side state is numpy; everything per token is computed with array ops over the plan. A
step's per-row inputs go into one static token-major table, [rows, NUM_COLS] int64, so that
the device reads every step from the same addresses (what a CUDA graph replays) and the rows a
step uses are one contiguous host-to-device copy. Where the device is not the host, the
backend gives the batch its staging (cuda: a small ring of pinned tables, so a table is never
rewritten while its copy may still be queued).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from gapless.common.config import EngineConfig, max_seq_blocks
from gapless.common.messages import StepPlan
from gapless.gpu_runner.attention import StepLayout
from gapless.gpu_runner.graph import capture_sizes, padded_size

# columns of the token table; rows past a column's length hold stale values and are never read
IDS = 0  # [T] fed token id, or -1: read last_token[slot] on the device
TOK_SLOT = 1  # [T] slot of each token
POSITIONS = 2  # [T] position of each token
SLOT_MAPPING = 3  # [T] cache row each token's K/V is written to
LOGIT_ROWS = 4  # [B_s] row whose logits are sampled; padded decodes: then 0s up to the size
SAMPLE_SLOTS = 5  # [B_s] slot of each sampling entry
SAMPLE_POSITIONS = 6  # [B_s] position the sampled token will take
FED_SLOTS = 7  # [F] slot of each token fed by the plan (penalty bookkeeping)
FED_POSITIONS = 8  # [F]
FED_IDS = 9  # [F]
NUM_COLS = 10
_EMPTY = np.zeros(0, np.int64)


@dataclass
class StepInputs:
    """Sizes of one prepared step; its tensors are views of the batch's static table."""

    num_rows: int  # rows the model runs: T, or the padded size of a decode batch
    num_tokens: int  # T, real query tokens
    num_sample: int  # B_s, entries that sample
    num_fed: int  # F, tokens carried by the plan
    padded: bool  # a decode-only batch run as num_rows entries by the graph layer
    layout: StepLayout
    sample_slots_host: np.ndarray  # [B_s] int64
    fed_slots_host: np.ndarray  # [F] int64
    # prompt rows scored for prompt logprobs: their logits follow the B_s sampled ones
    num_scored: int = 0  # P
    scored_slots_host: np.ndarray | None = None  # [P] int64
    scored_positions_host: np.ndarray | None = None  # [P] int64, of the token scored (row + 1)
    # a step with drafts: the B_s logit rows are each sampling entry's 1 + d rows in order
    sample_counts: np.ndarray | None = None  # [E_s] int64 1 + drafts of each sampling entry
    sample_drafts: list[list[int]] | None = None  # [E_s] each one's drafted ids
    entry_slots_host: np.ndarray | None = None  # [E_s] int64 slot of each sampling entry


class TableStaging(Protocol):
    """How a step's table reaches the device: written on the host, then uploaded."""

    table: torch.Tensor  # [rows, NUM_COLS] long, on the device: what the model reads

    def host(self) -> np.ndarray:
        """[rows, NUM_COLS] int64: the host table the next step is written into."""
        ...

    def upload(self, rows: int) -> None:
        """Copy the first rows of the last host table to `table`, on the current stream."""
        ...


class SharedTable:
    """The host's table is the device's (cpu, sim): nothing to upload."""

    def __init__(self, shape: tuple[int, int]) -> None:
        self.table = torch.zeros(shape, dtype=torch.long)  # [rows, NUM_COLS] long
        self._host = self.table.numpy()

    def host(self) -> np.ndarray:
        return self._host

    def upload(self, rows: int) -> None:
        pass


# makes the staging of a (rows, NUM_COLS) table for a device
MakeStaging = Callable[[tuple[int, int], torch.device], TableStaging]


class PersistentBatch:
    def __init__(
        self,
        max_slots: int,
        max_blocks_per_seq: int,
        block_size: int,
        max_rows: int,
        device,
        staging: MakeStaging | None = None,
    ) -> None:
        """staging: None where the device reads the host's memory (SharedTable)."""
        self.block_size = block_size
        self.device = torch.device(device)
        self.block_table = np.zeros((max_slots, max_blocks_per_seq), dtype=np.int64)
        self.num_blocks = np.zeros(max_slots, dtype=np.int64)
        # [max_slots] tokens whose KV the slot's steps so far wrote and kept: where a
        # device-fed entry starts, ahead of the plan's start_pos by the drafts accepted in steps
        # the core had not applied when it planned (equal without drafts)
        self.length = np.zeros(max_slots, dtype=np.int64)
        self.drafting = np.zeros(max_slots, dtype=bool)  # [max_slots] length is followed
        self.active = np.zeros(max_slots, dtype=bool)
        # [max_slots] long, on device: the token each slot sampled last
        self.last_token = torch.zeros(max_slots, dtype=torch.long, device=self.device)
        shape = (max_rows, NUM_COLS)
        self.staging = SharedTable(shape) if staging is None else staging(shape, self.device)
        # a verify of decodes runs as padded decode rows (prepare); off where a device's
        # graphs are not built for it
        self.expand_verify = False
        self.max_padded = capture_sizes(max_slots)[-1]
        self.table = self.staging.table  # [rows, NUM_COLS] long, on device
        self._arange = np.arange(max_rows + 1)  # [max_rows + 1] int64, never written
        self._ones = np.ones(max_rows, dtype=np.int64)  # never written
        self._arange.flags.writeable = self._ones.flags.writeable = False

    @property
    def max_blocks_per_seq(self) -> int:
        return self.block_table.shape[1]

    def resize_tables(self, max_blocks_per_seq: int) -> None:
        """Block tables of another length, while no slot is in use (the cuda runner's, once
        its KV cache is sized)."""
        assert not self.active.any(), "block tables resized with slots in use"
        self.block_table = np.zeros((len(self.active), max_blocks_per_seq), dtype=np.int64)

    def add(self, slot: int, drafting: bool = False) -> None:
        assert not self.active[slot], f"slot {slot} added twice"
        self.active[slot] = True
        self.num_blocks[slot] = 0
        self.length[slot] = 0
        self.drafting[slot] = drafting

    def remove(self, slot: int) -> None:
        assert self.active[slot], f"slot {slot} freed while not in use"
        self.active[slot] = False

    def column(self, col: int, rows: int) -> torch.Tensor:  # [rows] long, on device
        return self.table[:rows, col]

    def upload(self, inp: StepInputs) -> None:
        """Copy the prepared rows to the device table, on the current stream."""
        self.staging.upload(inp.num_rows)

    def append_blocks(self, plan: StepPlan) -> None:
        """Append each entry's new blocks after the ones the slot already has."""
        if not plan.new_blocks:
            return
        slots = np.asarray(plan.slots, dtype=np.int64)  # [B]
        nb = np.asarray(plan.num_new_blocks, dtype=np.int64)  # [B]
        if len(plan.new_blocks) == plan.num_new_blocks.count(1):  # decodes: one at most
            rows = slots[nb == 1]
            self.block_table[rows, self.num_blocks[rows]] = plan.new_blocks
        else:
            rows = np.repeat(slots, nb)
            offs = np.arange(nb.sum()) - np.repeat(np.cumsum(nb) - nb, nb)
            self.block_table[rows, self.num_blocks[rows] + offs] = plan.new_blocks
        self.num_blocks[slots] += nb  # a plan names each slot once

    def prepare(
        self,
        plan: StepPlan,
        pad: bool = True,
        scored_until: np.ndarray | None = None,
        drafts: list[list[int]] | None = None,
        blocks_appended: bool = False,
    ) -> StepInputs:
        """Fill the host table for one step and describe it; pad a decode-only batch to its
        capture size when `pad`. upload() then moves the rows to the device. blocks_appended:
        append_blocks(plan) was called already (before a draft model wrote its KV).

        scored_until [max_slots]: a fed row at position p of a slot whose prompt logprobs are
        asked is scored (its logits kept, for the token at p + 1) while p + 1 < scored_until.
        drafts [B]: ids each device-fed entry verifies after its last token (each row's logits
        are sampled), or None."""
        bs = self.block_size
        slots = np.asarray(plan.slots, dtype=np.int64)  # [B]
        start = np.asarray(plan.start_pos, dtype=np.int64)  # [B]
        assert self.active[slots].all(), "plan schedules a slot that is not in use"
        d = None  # [B] drafts per entry, when any
        if drafts is not None:
            d = np.fromiter(map(len, drafts), np.int64, len(slots))
            d = d if d.any() else None
        drafting = self.drafting[slots]
        if drafting.any():  # their device-fed entries start where the kept tokens end
            own = drafting & ~np.asarray(plan.has_tokens, dtype=bool)
            assert (self.length[slots][own] >= start[own]).all(), "a slot behind its plan"
            start = np.where(own, self.length[slots], start)

        if not blocks_appended:
            self.append_blocks(plan)

        # per token: entry, position, cache row
        b = len(slots)
        # why a branch: steady decode is most steps, and each array op skipped saves time on
        # the hot path (bench/RESULTS.md, "Core and detokenizer")
        decode = d is None and not plan.token_ids and plan.num_tokens.count(1) == b
        if decode:  # one token per entry, each read from last_token on the device
            t, n = b, None
            ends = self._arange[1 : b + 1]
            positions, tok_slot, fed_rows = start, slots, _EMPTY
        else:
            n = np.asarray(plan.num_tokens, dtype=np.int64)  # [B]
            if d is not None:
                n = n + d
            t = int(n.sum())
            ends = np.cumsum(n)
            entry = np.repeat(np.arange(b), n)  # [T]
            positions = start[entry] + np.arange(t) - (ends - n)[entry]
            tok_slot = slots[entry]
            fed_rows = np.flatnonzero(np.asarray(plan.has_tokens, dtype=bool)[entry])
        # a verify of device-fed decodes runs as decode rows, one per token (each query's
        # context ends at its own position; the step's K/V are written before attention reads),
        # so it takes the padded decode path and its compiled graph, not an eager mixed step
        expand = (
            self.expand_verify
            and d is not None
            and not plan.token_ids
            and plan.num_tokens.count(1) == b
            and t <= self.max_padded
        )
        padded = pad and (t == b or expand)
        num_rows = padded_size(t) if padded else t
        ctx_len = start + (1 if decode else n)
        self.length[slots] = ctx_len  # the executor takes back the drafts it rejects
        if all(plan.sample):
            picked = self._arange[:b]
            logit_rows, sample_slots, sample_ctx = ends - 1, slots, ctx_len
        else:
            picked = np.flatnonzero(np.asarray(plan.sample, dtype=bool))
            logit_rows, sample_slots, sample_ctx = ends[picked] - 1, slots[picked], ctx_len[picked]
        verify = None
        if d is not None:  # every row of a drafting entry is sampled, its last token's first
            assert drafts is not None
            cnt = d[picked] + 1  # [E_s]
            within = np.arange(int(cnt.sum())) - np.repeat(np.cumsum(cnt) - cnt, cnt)
            logit_rows = np.repeat(ends[picked] - cnt, cnt) + within
            sample_slots, sample_ctx = np.repeat(slots[picked], cnt), positions[logit_rows] + 1
            verify = cnt, [drafts[j] for j in picked.tolist()], slots[picked]
        s, f = len(logit_rows), len(fed_rows)

        table = self.staging.host()
        table[:t, IDS] = -1
        if f:
            table[fed_rows, IDS] = plan.token_ids
        if d is not None:  # drafts follow each entry's device-fed last token
            assert drafts is not None
            draft_rows = (
                np.repeat(ends - d, d) + np.arange(int(d.sum())) - np.repeat(np.cumsum(d) - d, d)
            )
            table[draft_rows, IDS] = [i for ids in drafts for i in ids]
        table[:t, TOK_SLOT] = tok_slot
        table[:t, POSITIONS] = positions
        table[:t, SLOT_MAPPING] = self.block_table[tok_slot, positions // bs] * bs + positions % bs
        table[t:num_rows, :LOGIT_ROWS] = 0  # dummies: token 0 at position 0, K/V into block 0
        table[:s, LOGIT_ROWS] = logit_rows
        scored = _EMPTY
        if scored_until is not None and f:
            scored = fed_rows[positions[fed_rows] + 1 < scored_until[tok_slot[fed_rows]]]
        p = len(scored)
        table[s : s + p, LOGIT_ROWS] = scored
        table[s + p : num_rows, LOGIT_ROWS] = 0
        table[:s, SAMPLE_SLOTS] = sample_slots
        table[:s, SAMPLE_POSITIONS] = sample_ctx
        if f:
            table[:f, FED_SLOTS] = tok_slot[fed_rows]
            table[:f, FED_POSITIONS] = positions[fed_rows]
            table[:f, FED_IDS] = plan.token_ids

        num_entries = num_rows if padded else b
        pages = -(-int(ctx_len.max()) // bs)
        page_table = np.zeros((num_entries, pages), dtype=np.int64)
        entry_ctx = np.ones(num_entries, dtype=np.int64)
        if padded and not decode:  # an expanded verify: an entry per row
            page_table[:t] = self.block_table[tok_slot, :pages]
            entry_ctx[:t] = positions + 1
        else:
            page_table[:b] = self.block_table[slots, :pages]
            entry_ctx[:b] = ctx_len
        layout = StepLayout(
            num_tokens=self._ones[:num_entries] if padded or decode else n,
            ctx_len=entry_ctx,
            page_table=page_table,
            block_size=bs,
        )
        return StepInputs(
            num_rows=num_rows,
            num_tokens=t,
            num_sample=s,
            num_fed=f,
            padded=padded,
            layout=layout,
            sample_slots_host=sample_slots,
            fed_slots_host=tok_slot[fed_rows],
            num_scored=p,
            scored_slots_host=tok_slot[scored],
            scored_positions_host=positions[scored] + 1,
            sample_counts=None if verify is None else verify[0],
            sample_drafts=None if verify is None else verify[1],
            entry_slots_host=None if verify is None else verify[2],
        )


def batch_for(
    config: EngineConfig, device, num_blocks: int, staging: MakeStaging | None = None
) -> PersistentBatch:
    """The batch of a runner with this config and a KV cache of num_blocks: a seat per
    sequence, a table row per token of the largest step or padded decode, and per seat a
    block table as long as a sequence can be in that cache (config.max_seq_blocks)."""
    rows = max(config.max_num_batched_tokens, capture_sizes(config.max_num_seqs)[-1])
    max_blocks = max_seq_blocks(config.model.max_model_len, config.block_size, num_blocks)
    return PersistentBatch(
        config.max_num_seqs, max_blocks, config.block_size, rows, device, staging
    )
