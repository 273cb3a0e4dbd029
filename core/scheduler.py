"""Continuous batching with one token budget per step, chunked prefill and preemption.

Contract: `schedule() -> ScheduledStep | None` plans the next step assuming every running
request continues; `update_from_output(step, result) -> StepOutput` applies a step's sampled
ids once they arrive. Several steps may be in flight between the two.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from core.kv_blocks import BlockManager, SlotManager
from core.messages import AddRequest, NewSlot, StepPlan, StepResult
from core.request import Request, Status


@dataclass
class ScheduledStep:
    plan: StepPlan
    sampled: list[Request]  # requests of the entries that sample, in entry order
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    plan_sent: float = 0.0  # perf_counter when the plan left the core
    schedule_s: float = 0.0  # time spent building it


@dataclass
class StepOutput:
    """What a step's result means for the detokenizer: one token per live sampled request."""

    requests: list[Request] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    finish_reasons: list[str] = field(default_factory=list)
    logprob_rows: list[int] = field(default_factory=list)  # result rows of requests asking logprobs


class Scheduler:
    def __init__(
        self,
        *,
        num_blocks: int,
        block_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        eos_token_ids: tuple[int, ...],
    ) -> None:
        self.blocks = BlockManager(num_blocks, block_size)
        self.slots = SlotManager(max_num_seqs)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order; the newest is preempted first
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self._seq = 0

    # ------------------------------------------------------------------ requests in and out

    def add_request(self, msg: AddRequest) -> Request:
        req = Request(msg, self.eos_token_ids)
        assert req.request_id not in self.requests, f"duplicate request id {req.request_id}"
        self.requests[req.request_id] = req
        self.waiting.append(req)
        return req

    def fits_ever(self, req: Request) -> str | None:
        """Why a request could never run on this engine, or None."""
        need = min(req.num_prompt + req.params.max_tokens, self.max_model_len)
        if self.blocks.blocks_for(need) > self.blocks.num_usable:
            return (
                f"the request needs {need} tokens of KV cache but the engine holds "
                f"{self.blocks.num_usable * self.blocks.block_size}"
            )
        return None

    def finish(self, req: Request, reason: str) -> bool:
        """End a request and free what it holds; False if it had already ended."""
        if req.finished:
            return False
        if req.status is Status.RUNNING:
            self.running.remove(req)
            self._release(req)
        else:
            self.waiting.remove(req)
        req.status = Status.FINISHED
        req.finish_reason = reason
        if req.num_pending == 0:
            del self.requests[req.request_id]
        return True

    def _release(self, req: Request) -> None:
        self.blocks.free(req.blocks)
        req.blocks = []
        req.num_blocks_sent = 0
        self.slots.free(req.slot)
        req.slot = -1

    def preempt(self, req: Request) -> None:
        """Free a running request's KV and slot; it recomputes later, first in line."""
        self.running.remove(req)
        self._release(req)
        req.status = Status.WAITING
        req.num_computed = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    # ------------------------------------------------------------------ planning

    def schedule(self) -> ScheduledStep | None:
        budget = self.max_num_batched_tokens
        entries: list[tuple[Request, int, bool]] = []  # (request, num tokens, samples)
        new_slots: list[NewSlot] = []

        # 1. running requests: decodes and unfinished prompt chunks, oldest first
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_total - req.num_computed, budget)
            if n == 0 or (
                req.num_computed + n == req.num_total and req.reached_limit(self.max_model_len)
            ):
                i += 1
                continue
            if not self._grow(req, n):
                victim = self.running[-1]
                self.preempt(victim)
                if victim is req:
                    break
                continue
            entries.append(self._take(req, n))
            budget -= n
            i += 1

        # 2. waiting requests, in order; a preempted one waits until its tokens are known
        skipped: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            if req.num_pending:
                skipped.append(self.waiting.popleft())
                continue
            n = min(req.num_total - req.num_computed, budget)
            if not self.blocks.can_allocate(self.blocks.blocks_for(n)):
                break
            self.waiting.popleft()
            req.slot = self.slots.allocate()
            req.status = Status.RUNNING
            req.prefill_end = req.num_total
            self.running.append(req)
            self._grow(req, n)
            new_slots.append(
                NewSlot(slot=req.slot, params=req.params, num_prompt_tokens=req.num_prompt)
            )
            entries.append(self._take(req, n))
            budget -= n
        self.waiting.extendleft(reversed(skipped))

        freed = self.slots.take_freed()
        if not entries and not freed:
            return None
        return self._build(entries, new_slots, freed)

    def _grow(self, req: Request, n: int) -> bool:
        need = self.blocks.blocks_for(req.num_computed + n) - len(req.blocks)
        if need <= 0:
            return True
        if not self.blocks.can_allocate(need):
            return False
        req.blocks.extend(self.blocks.allocate(need))
        return True

    def _take(self, req: Request, n: int) -> tuple[Request, int, bool]:
        """Advance the request's counters for an entry of n tokens."""
        samples = req.num_computed + n == req.num_total
        req.num_computed += n
        if samples:
            req.num_total += 1
            req.num_pending += 1
        return req, n, samples

    def _build(self, entries, new_slots, freed) -> ScheduledStep:
        b = len(entries)
        slots, num_tokens, start_pos, has_tokens, sample, num_new_blocks = (
            [0] * b,
            [0] * b,
            [0] * b,
            [False] * b,
            [False] * b,
            [0] * b,
        )
        token_ids: list[int] = []
        new_blocks: list[int] = []
        sampled: list[Request] = []
        num_prefill = num_decode = 0
        for j, (req, n, samples) in enumerate(entries):
            start = req.num_computed - n
            slots[j], num_tokens[j], start_pos[j], sample[j] = req.slot, n, start, samples
            if start >= req.prefill_end:
                # a token sampled in this slot: only the runner's last_token[slot] may hold it yet
                assert n == 1, "a device-fed entry has one token"
                num_decode += 1
            else:
                has_tokens[j] = True
                token_ids.extend(req.known_tokens(start, start + n))
                num_prefill += n
            if len(req.blocks) > req.num_blocks_sent:
                num_new_blocks[j] = len(req.blocks) - req.num_blocks_sent
                new_blocks.extend(req.blocks[req.num_blocks_sent :])
                req.num_blocks_sent = len(req.blocks)
            if samples:
                sampled.append(req)
        self._seq += 1
        plan = StepPlan(
            seq=self._seq,
            new_slots=new_slots,
            freed_slots=freed,
            slots=slots,
            num_tokens=num_tokens,
            start_pos=start_pos,
            has_tokens=has_tokens,
            token_ids=token_ids,
            sample=sample,
            num_new_blocks=num_new_blocks,
            new_blocks=new_blocks,
        )
        return ScheduledStep(plan, sampled, num_prefill, num_decode)

    # ------------------------------------------------------------------ results

    def update_from_output(self, step: ScheduledStep, result: StepResult) -> StepOutput:
        """Append sampled ids, check token stops for the whole batch, finish what ended."""
        assert result.seq == step.plan.seq, f"result {result.seq} for plan {step.plan.seq}"
        out = StepOutput()
        tokens = np.asarray(result.token_ids, dtype=np.int64)
        for row, req in enumerate(step.sampled):
            req.num_pending -= 1
            if req.finished:
                # the one extra token of a request that ended a step earlier: dropped
                if req.num_pending == 0:
                    self.requests.pop(req.request_id, None)
                continue
            tok = int(tokens[row])
            req.output_ids.append(tok)
            if tok in req.stop_ids:
                reason = "stop"
            elif len(req.output_ids) >= req.params.max_tokens or (
                req.num_prompt + len(req.output_ids) >= self.max_model_len
            ):
                reason = "length"
            else:
                reason = ""
            if reason:
                self.finish(req, reason)
            out.requests.append(req)
            out.token_ids.append(tok)
            out.finish_reasons.append(reason)
            if req.params.logprobs is not None:
                out.logprob_rows.append(row)
        return out
