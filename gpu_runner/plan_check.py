"""The runner's boundary: a StepPlan its batch could not run is refused before it changes
anything (common/bad_messages.py): a StepRefused takes its result's place in line, and the
core ends that step's requests with an error. A plan out of sequence is counted and dropped
unanswered: no core awaits its result.

Plans come strictly in sequence; a plan frees only slots in use and adds only slots that are
free, schedules each slot in use at most once, appends blocks of the KV pool (never the reserved
block 0) within a slot's table, feeds ids of the vocabulary, and covers each entry's positions
with the slot's blocks. The backends keep their asserts for the same invariants inside the
process. Per step in steady decode: the slots compared with the last plan's, the positions made
an array and compared with the slots' blocks.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np

from gapless.common.bad_messages import BadMessages
from gapless.common.checks import params_problem
from gapless.common.config import EngineConfig
from gapless.common.messages import StepPlan

if TYPE_CHECKING:  # why: the runner process imports this before torch loads (cpu/threads.py)
    from gapless.gpu_runner.batch import PersistentBatch

log = logging.getLogger("gapless.gpu_runner")


class PlanCheck:
    def __init__(self, config: EngineConfig, batch: PersistentBatch, num_blocks: int) -> None:
        self.config = config
        self.batch = batch
        self.num_blocks = num_blocks  # the KV pool, block 0 included (reserved)
        self.max_rows = batch.table.shape[0]
        self.vocab = config.model.vocab_size
        self.last_seq = 0
        self.bad = BadMessages("gpu_runner", log)
        self._slots: list[int] | None = None  # the slots of the last plan that passed
        self._slot_array = np.zeros(0, np.int64)  # [B] the same

    def accept(self, plan: StepPlan) -> bool:
        """Whether to launch plan; a plan that breaks an invariant is counted and refused."""
        return self.refusal(plan) is None

    def refusal(self, plan: StepPlan) -> str | None:
        """None if plan may run, else why not (counted). A plan next in sequence moves the
        sequence on, refused or not, so the plans after it are judged on their own."""
        problem = self.problem(plan)
        last = self.last_seq
        if plan.seq == last + 1:
            self.last_seq = plan.seq
        if problem is None:
            return None
        reason, why = problem
        self.bad.report(reason, f"plan {plan.seq} (after {last}): {why}; refused")
        return f"{reason}: {why}"

    def problem(self, plan: StepPlan) -> tuple[str, str] | None:
        """(reason, detail) of the first invariant plan breaks, else None."""
        if plan.seq != self.last_seq + 1:
            return "plan_out_of_order", "not the next in sequence"
        b = len(plan.slots)
        n, pos, has, sample = plan.num_tokens, plan.start_pos, plan.has_tokens, plan.sample
        if not len(n) == len(pos) == len(has) == len(sample) == len(plan.num_new_blocks) == b:
            return "plan_shape", f"per-entry lists of lengths other than {b}"
        active = self.batch.active
        if plan.freed_slots or plan.new_slots:
            why = self._slot_changes(plan)
            if why is not None:
                return "plan_slots", why
            active = active.copy()
            active[plan.freed_slots] = False
            active[[new.slot for new in plan.new_slots]] = True
        elif plan.slots == self._slots:  # steady decode: the slots the last plan had
            return self._entries(plan, self._slot_array)
        slots = np.fromiter(plan.slots, np.int64, b)  # [B]
        if b and slots.min() < 0:
            return "plan_slots", "an entry names a negative slot"
        uses = np.bincount(slots, minlength=len(active))  # [S] entries per slot
        if len(uses) > len(active) or (uses > active).any():  # a slot not in use, or twice
            return "plan_slots", "an entry names a slot not in use, or a slot twice"
        problem = self._entries(plan, slots)
        if problem is None:  # why: the set in use changes only with a plan that passed here
            self._slots, self._slot_array = plan.slots, slots
        return problem

    def _slot_changes(self, plan: StepPlan) -> str | None:
        """Freed slots are in use, new ones free once those are freed; new slots' params in
        range. A few per step at most."""
        active, n = self.batch.active, len(self.batch.active)
        freed = plan.freed_slots
        if len(set(freed)) != len(freed) or not all(0 <= s < n and active[s] for s in freed):
            return f"frees {freed}: a slot not in use, or twice"
        gone = set(freed)
        new = [x.slot for x in plan.new_slots]
        if len(set(new)) != len(new) or not all(
            0 <= s < n and (not active[s] or s in gone) for s in new
        ):
            return f"adds {new}: a slot in use, or twice"
        for x in plan.new_slots:
            why = params_problem(x.params, self.config)
            if why is None and not self._in_vocab(x.cached_ids, x.prompt_token_ids):
                why = "ids outside the vocabulary"
            if why is not None:
                return f"slot {x.slot}: {why}"
        return None

    def _entries(self, plan: StepPlan, slots: np.ndarray) -> tuple[str, str] | None:
        """Tokens, blocks and positions of the entries (slots already checked)."""
        b = len(slots)
        decode = not plan.token_ids and plan.num_tokens.count(1) == b
        if decode and plan.has_tokens.count(True):
            return "plan_tokens", "an entry without ids says it has them"
        num = None if decode else np.asarray(plan.num_tokens, np.int64)  # [B]
        if num is not None:
            has = np.asarray(plan.has_tokens, bool)
            fed = int(num[has].sum())
            if b and (num.min() < 1 or (num[~has] != 1).any()) or num.sum() > self.max_rows:
                return "plan_tokens", "an entry of no tokens, or too many"
            if fed != len(plan.token_ids) or not self._in_vocab(plan.token_ids):
                why = f"{len(plan.token_ids)} ids for {fed} fed tokens, or one past the vocabulary"
                return "plan_tokens", why
        new_blocks = plan.new_blocks
        held = self.batch.num_blocks[slots]  # [B] blocks each slot holds before this step
        if plan.new_slots:  # a slot added by this plan starts with none
            held[np.isin(slots, [x.slot for x in plan.new_slots])] = 0
        if new_blocks or plan.num_new_blocks.count(0) != b:
            nb = np.asarray(plan.num_new_blocks, np.int64)  # [B]
            if nb.min() < 0 or nb.sum() != len(new_blocks):
                return "plan_blocks", f"{len(new_blocks)} blocks for {int(nb.sum())} appended"
            if min(new_blocks) < 1 or max(new_blocks) >= self.num_blocks:
                return "plan_blocks", f"a block outside [1, {self.num_blocks})"
            held = held + nb
            if held.max() > self.batch.block_table.shape[1]:
                return "plan_blocks", "a slot past its block table"
        if b:
            start = np.fromiter(plan.start_pos, np.int64, b)  # [B]
            end = held * self.batch.block_size  # [B] positions the slot's blocks hold
            if num is not None:
                end -= num - 1  # [B] past the last start that fits
            # 0 <= start < end, as one unsigned compare: a negative start is huge unsigned
            if np.count_nonzero(np.greater_equal(start.view(np.uint64), end.view(np.uint64))):
                return "plan_positions", "an entry's positions outside its slot's blocks"
        return None

    def _in_vocab(self, *lists: list[int]) -> bool:
        vocab = self.vocab
        return all(not ids or (min(ids) >= 0 and max(ids) < vocab) for ids in lists)
