"""Planning a step over the running set's view (RunningBatch.rows()).

Two paths make the same plans. While every running request decodes and nobody can take a
seat, the steady-decode plan feeds every row its last token with a few array operations over
the view, keeping the KV capacity of its rows across steps; where rows draft, the same view
plans their verify on counts (1 + k positions each), as cheaply. Otherwise the general plan gives
each running request the tokens it still needs within the budget (preempting while the KV
blocks run short), seats waiting requests with what is left, and builds the plan entry by
entry. Both hand the step the view of the rows it samples, which applying its result reads.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from gapless.common.messages import NewSlot, StepPlan
from gapless.core.admit import charge_prompt
from gapless.core.kv_blocks import BlockManager, SlotManager
from gapless.core.policy import Policy
from gapless.core.request import Request
from gapless.core.rows import Rows
from gapless.core.running import RunningBatch
from gapless.core.spec_cost import SpecCost
from gapless.core.step import ScheduledStep
from gapless.core.window import WindowRelease

_EMPTY = np.zeros(0, np.int64)


class Planner:
    def __init__(
        self,
        rb: RunningBatch,
        blocks: BlockManager,
        slots: SlotManager,
        policy: Policy,
        max_num_batched_tokens: int,
        preempt: Callable[[Request], None],
        window: WindowRelease | None = None,
        spec_cost: SpecCost | None = None,
    ) -> None:
        self.spec_cost = SpecCost() if spec_cost is None else spec_cost  # drafts per step
        self.rb = rb
        self.blocks = blocks
        self.slots = slots
        self.policy = policy
        self.max_num_batched_tokens = max_num_batched_tokens
        self.preempt = preempt
        self.window = window  # gives back blocks behind a sliding window; None: keep them all
        self.seq = 0  # of the last plan
        # the view the steady-decode arrays below belong to; None after a general step, which
        # moves the counters they hold
        self._steady: Rows | None = None
        self._capacity = _EMPTY  # [n] tokens its KV blocks hold: a step starting there needs one
        self._feed_below = _EMPTY  # [n] limit - 1: computed this far, its last sample is in flight
        self._free_at = _EMPTY  # [n] a step starting there gives back a block (WindowRelease)

    def plan_decode(self, rows: Rows) -> ScheduledStep | None:
        """Every running request feeds its last token and samples one (or verifies its drafts:
        _plan_verify); a request whose blocks are full gets one more. None if one of them
        still prefills, there is nothing to feed or the token budget or the blocks run short
        (the general plan preempts), having changed nothing but given back blocks that fell
        out of a sliding window."""
        rb, bs = self.rb, self.blocks.block_size
        if self._steady is not rows:
            if not rb.decodes_all(rows.slots):
                return None
            # why: where the cost model stops drafting for this batch (k* = 0 for every row
            # decoding) and no verify is in flight, the batch decodes plainly until it changes
            if not self._drafts_stopped(rows):
                return self._plan_verify(rows)
            self._capacity = rb.num_blocks[rows.slots] * bs
            self._feed_below = rows.limit - 1
            if self.window is not None:
                self._free_at = self.window.free_at(rows.slots)
            self._steady = rows
        step_rows, slots, capacity = rows, rows.slots, self._capacity
        start = rb.computed[slots]
        fed = None  # rows that feed a token, when not all do
        if not (feeds := start < self._feed_below).all():  # its last sample is in flight
            fed = np.flatnonzero(feeds)
            step_rows, start, capacity = rows.take(fed), start[fed], capacity[fed]
            slots = step_rows.slots
        n = len(slots)
        if self.window is not None and n:
            self._slide(step_rows, start, fed)
        full = np.flatnonzero(start >= capacity)  # every block_size steps per request
        if not n or n > self.max_num_batched_tokens or not self.blocks.can_allocate(len(full)):
            return None
        num_new_blocks, new_blocks = [0] * n, []
        if len(full):
            new_blocks = self._grow(step_rows, full, num_new_blocks)
            self._capacity[full if fed is None else fed[full]] += bs
        return self._decode_step(rows, step_rows, start, num_new_blocks, new_blocks, None)

    def _plan_verify(self, rows: Rows) -> ScheduledStep | None:
        """Every running request feeds its last token and verifies up to k drafts after it,
        planned on counts as the general plan plans it (1 + k positions of KV per row, on
        top of what the verifies in flight may still accept), in a few array operations.
        None where the general plan must decide: a sliding window, a budget or block pool
        that runs short, a row not fed this step that needs a block."""
        self._steady = None
        rb, bs = self.rb, self.blocks.block_size
        if self.window is not None:
            return None
        rs = rows.slots
        total, comp, extra = rb.num_tokens(rs), rb.computed[rs], rb.spec_extra[rs]
        feeds = total + extra < rows.limit  # [n] false: its last allowed sample is in flight
        need = feeds.astype(np.int64)
        drafts = (rows.spec_k > 0) & feeds
        k = self._spec_k(rows.spec_k, drafts, need)
        draft = np.where(drafts, np.clip(np.minimum(k, rows.limit - total - extra - 1), 0, None), 0)
        ahead = np.where(feeds, extra + draft, 0)  # how far the runner may write past
        grow = np.maximum(-(-(comp + need + ahead) // bs) - rb.num_blocks[rs], 0)
        num_fed, num_grow = int(need.sum()), int(grow.sum())
        if (
            not num_fed
            or num_fed + int(draft.sum()) > self.max_num_batched_tokens
            or not self.blocks.can_allocate(num_grow)
        ):
            return None
        new_blocks: list[int] = []
        if num_grow:  # a block per row every few steps: allocated at once, handed out in order
            grown = np.flatnonzero(grow)
            if not feeds[grown].all():  # a row not fed grows: the general plan decides
                return None
            new_blocks = self.blocks.allocate(num_grow)
            requests, at = rows.requests, 0
            for j, g in zip(grown.tolist(), grow[grown].tolist(), strict=True):
                requests[j].blocks.extend(new_blocks[at : at + g])
                at += g
            rb.num_blocks[rs] += grow
            rb.num_sent[rs] = rb.num_blocks[rs]
        step_rows = rows
        if not feeds.all():
            fed = np.flatnonzero(feeds)
            step_rows, comp, grow, draft = rows.take(fed), comp[fed], grow[fed], draft[fed]
        rb.spec_extra[step_rows.slots] += draft
        return self._decode_step(rows, step_rows, comp, grow.tolist(), new_blocks, draft)

    def _decode_step(
        self,
        rows: Rows,
        step_rows: Rows,
        start: np.ndarray,
        num_new_blocks: list[int],
        new_blocks: list[int],
        draft: np.ndarray | None,
    ) -> ScheduledStep:
        """The step of step_rows (rows, or those of them fed), each feeding the token at [n]
        start (the runner's last sample) and sampling, verifying [n] draft after it where any;
        rows: the running set the plan was made over."""
        rb, slots, n = self.rb, step_rows.slots, len(start)
        rb.computed[slots] = start + 1
        rb.pending[slots] += 1
        drafts = draft if draft is not None and draft.any() else None
        self.seq += 1
        plan = StepPlan(
            seq=self.seq,
            new_slots=[],
            freed_slots=self.slots.take_freed(),
            slots=step_rows.slot_list,
            num_tokens=[1] * n,
            start_pos=start.tolist(),
            has_tokens=[False] * n,
            token_ids=[],
            sample=[True] * n,
            num_new_blocks=num_new_blocks,
            new_blocks=new_blocks,
            num_draft=[] if drafts is None else drafts.tolist(),
        )
        return ScheduledStep(
            plan=plan,
            rows=step_rows,
            drafts=drafts,
            num_decode_tokens=n,
            num_released=rb.num_released,
            decode=rows,
        )

    def _slide(self, rows: Rows, start: np.ndarray, fed: np.ndarray | None) -> None:
        """Give back the blocks that fell out of the window of rows starting at [n] start
        (every block_size steps per request); fed: their indices in the steady view."""
        assert self.window is not None and rows.slots is not None
        free_at = self._free_at if fed is None else self._free_at[fed]
        due = np.flatnonzero(start >= free_at)
        if len(due):
            self.window.release(rows, due, start)
            at = due if fed is None else fed[due]
            self._free_at[at] = self.window.free_at(rows.slots[due])

    def _grow(self, rows: Rows, full: np.ndarray, num_new_blocks: list[int]) -> list[int]:
        """One more block for each of these rows ([k] row indices), sent with this step."""
        new_blocks = self.blocks.allocate(len(full))
        requests = rows.requests
        for j, block in zip(full.tolist(), new_blocks, strict=True):
            requests[j].blocks.append(block)
            num_new_blocks[j] = 1
        grown = rows.slots[full]
        self.rb.num_blocks[grown] += 1
        self.rb.num_sent[grown] += 1
        return new_blocks

    def plan_running(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Tokens each running request feeds this step, preempting the policy's victim while
        the KV blocks they need are not there. Returns the entries' [E] slots, [E] tokens and
        [E] drafts each may verify after its token, oldest first.

        Counts with drafts in flight: `total` and `computed` count one token per step, the
        drafts those steps may accept (`spec_extra`) are reserved on top: KV for them, and no
        step is planned whose drafts could pass the length limit."""
        self._steady = None
        rb, bs = self.rb, self.blocks.block_size
        if self.window is not None and rb.running:
            rows = rb.rows()
            self.window.release_due(rows, rb.computed[rows.slots])
        while rb.running:
            rows = rb.rows()
            rs = rows.slots
            total, comp = rb.num_tokens(rs), rb.computed[rs]
            extra = rb.spec_extra[rs]  # [n] drafts steps in flight may still accept
            need = total - comp
            # a request whose last allowed sample is in flight feeds nothing until it finishes
            need[(need == 1) & (total + extra >= rows.limit)] = 0
            cost = need
            drafts = rows.spec_k > 0
            if drafts.any():  # a decoding row verifies up to k drafts, within the limit
                drafts &= (need == 1) & (comp >= rb.prefill_end[rs])
                k = self._spec_k(rows.spec_k, drafts, need)
                room = rows.limit - total - extra - 1
                cost = need + np.where(drafts, np.clip(np.minimum(k, room), 0, None), 0)
            before = np.cumsum(cost) - cost
            fits = np.clip(self.max_num_batched_tokens - before, 0, cost)
            take = np.minimum(fits, need)
            draft = fits - take
            ahead = np.where(take > 0, extra + draft, 0)  # how far the runner may write past
            grow = np.maximum(-(-(comp + take + ahead) // bs) - rb.num_blocks[rs], 0)
            if self.blocks.can_allocate(int(grow.sum())):
                for j in np.flatnonzero(grow):
                    rows.requests[j].blocks.extend(self.blocks.allocate(int(grow[j])))
                rb.num_blocks[rs] += grow
                keep = take > 0
                return rs[keep], take[keep], draft[keep]
            self.preempt(self.policy.victim(rb.running))
        return _EMPTY, _EMPTY, _EMPTY

    def _drafts_stopped(self, rows: Rows) -> bool:
        """No row of rows drafts this step: none may, or the cost model stops them all."""
        k = rows.spec_k
        if not k.any():
            return True
        if self.rb.spec_extra[rows.slots].any() or not self.spec_cost.has_model:
            return False
        n = len(rows.slots)
        drafting = int((k > 0).sum())
        return self.spec_cost.best_k(drafting, n, n - drafting, int(k.max())) == 0

    def _spec_k(self, spec_k: np.ndarray, drafts: np.ndarray, need: np.ndarray) -> np.ndarray:
        """[n] drafts each row may verify this step: its k, capped where the device's cost
        model says more drafts lose (core/spec_cost.py)."""
        num_drafting = int(drafts.sum())
        if not num_drafting or not self.spec_cost.has_model:
            return spec_k
        tokens = min(int(need.sum()), self.max_num_batched_tokens)
        others = int((need == 1).sum()) - num_drafting
        best = self.spec_cost.best_k(num_drafting, tokens, others, int(spec_k[drafts].max()))
        return np.minimum(spec_k, best)

    def build(
        self,
        slots: np.ndarray,
        take: np.ndarray,
        new_slots: list[NewSlot],
        freed: list[int],
        num_cached: int,
        rows: Rows | None = None,
        draft: np.ndarray | None = None,
    ) -> ScheduledStep:
        """The general plan of these entries ([E] slots, [E] tokens each, [E] drafts each may
        verify), admitted ones last; rows: the running set's view when the entries are its
        rows in order and all sample."""
        rb = self.rb
        start = rb.computed[slots]
        sample = start + take == rb.num_tokens(slots)
        has_tokens = start < rb.prefill_end[slots]
        token_ids, scorers = self._feed(slots, start, take, has_tokens)
        assert (take[~has_tokens] == 1).all(), "a device-fed entry has one token"
        new_count = rb.num_blocks[slots] - rb.num_sent[slots]
        new_blocks: list[int] = []
        for j in np.flatnonzero(new_count):  # one block per request every block_size steps
            req = rb.req[slots[j]]
            assert req is not None
            new_blocks.extend(req.blocks[int(rb.num_sent[slots[j]]) :])
        rb.num_sent[slots] = rb.num_blocks[slots]
        rb.computed[slots] += take
        sample_slots = slots[sample]
        rb.pending[sample_slots] += 1
        if rows is None or len(sample_slots) < len(slots):
            rows = rb.gather(sample_slots)
        drafts = None  # [R] drafts of the sampled rows, when any drafts
        if draft is not None and draft.any():
            rb.spec_extra[slots] += draft
            drafts = draft[sample]
        self.seq += 1
        plan = StepPlan(
            seq=self.seq,
            new_slots=new_slots,
            freed_slots=freed,
            slots=slots.tolist(),
            num_tokens=take.tolist(),
            start_pos=start.tolist(),
            has_tokens=has_tokens.tolist(),
            token_ids=token_ids,
            sample=sample.tolist(),
            num_new_blocks=new_count.tolist(),
            new_blocks=new_blocks,
            num_draft=[] if drafts is None else draft.tolist(),
        )
        return ScheduledStep(
            plan=plan,
            rows=rows,
            drafts=drafts,
            num_prefill_tokens=int(take[has_tokens].sum()),
            num_decode_tokens=int((~has_tokens).sum()),
            num_cached_tokens=num_cached,
            num_released=rb.num_released,
            scorers=scorers,
        )

    def _feed(
        self, slots: np.ndarray, start: np.ndarray, take: np.ndarray, has_tokens: np.ndarray
    ) -> tuple[list[int], dict[int, Request]]:
        """The ids the entries that carry tokens feed (prompt chunks and recomputes: a few per
        step), charging prompt tokens as they are planned; and slot -> the request each
        prompt-scoring entry scores."""
        token_ids: list[int] = []
        scorers: dict[int, Request] = {}
        for j in np.flatnonzero(has_tokens):
            req = self.rb.req[slots[j]]
            assert req is not None
            begin, end = int(start[j]), int(start[j] + take[j])
            token_ids.extend(req.known_tokens(begin, end))
            charge_prompt(self.policy, req, end)
            if req.prompt_logprobs is not None:
                scorers[int(slots[j])] = req
        return token_ids, scorers
