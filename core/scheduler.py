"""Continuous batching with one token budget per step, chunked prefill and preemption.

Contract: `schedule() -> ScheduledStep | None` plans the next step assuming every running
request continues; `update_from_output(step, result) -> StepOutput` applies a step's sampled
ids once they arrive. Several steps may be in flight between the two. Running requests'
counters live in arrays indexed by slot (core/running.py) and a step reads its rows through
one view of them (core/rows.py), so a decode step is planned and applied with array
operations over the batch.

The scheduler composes: admission (core/admit.py), the steady-decode and the general plan
(core/plan.py), applying results and stop checks (core/apply.py), prefix-cache bookkeeping
(core/prefix.py). It owns the requests' life: arrival, the wait (the policy's queue),
preemption and the end.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from gapless.common.config import max_seq_blocks
from gapless.common.kv_events import KvEventLog
from gapless.common.messages import AddRequest, StepResult
from gapless.core.admit import Admission
from gapless.core.apply import Applier
from gapless.core.kv_blocks import BlockManager, SlotManager
from gapless.core.lora import LoraSeats
from gapless.core.plan import Planner
from gapless.core.policy import Policy
from gapless.core.prefix import PrefixCache
from gapless.core.request import Request, Status
from gapless.core.running import RunningBatch
from gapless.core.spec_cost import SpecCost
from gapless.core.step import ScheduledStep, StepOutput
from gapless.core.window import WindowRelease

__all__ = ["ScheduledStep", "Scheduler", "StepOutput"]


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
        policy: Policy | None = None,
        prefix_caching: bool = True,
        model_salt: str = "",
        # ModelInfo.kv_window: running requests give back the blocks behind it (core/window.py)
        window: int = 0,
        kv_events: KvEventLog | None = None,  # what the cache's changes are logged to
        # speculation: the drafter of every request ("off": only requests with a prediction
        # draft) and the drafts a decoding request verifies per step (0: none)
        speculative: str = "off",
        num_speculative_tokens: int = 0,
        # the device's step time by tokens fed ([N] tokens, [N] seconds; RunnerReady): where
        # drafts make a step lose, fewer or none (core/spec_cost.py); None: always k
        step_costs: tuple[list[int], list[float]] | None = None,
        # LoRA: adapters a step may mix (core/lora.py; 0: any number) and those read already
        max_loras: int = 0,
        lora_ready: tuple[str, ...] = (),
    ) -> None:
        self.speculative = speculative
        self.num_speculative_tokens = num_speculative_tokens
        self.blocks = BlockManager(num_blocks, block_size, prefix_caching, kv_events)
        self.slots = SlotManager(max_num_seqs)
        # a sequence never outgrows the cache (fits_ever), whatever context the model declares
        longest = max_seq_blocks(max_model_len, block_size, num_blocks) * block_size
        self.rb = RunningBatch(max_num_seqs, max_model_len, min(max_model_len, longest))
        self.running = self.rb.running  # admission order; the policy picks whom to preempt
        self.prefix = PrefixCache(self.blocks, self.rb, prefix_caching, model_salt)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.policy = Policy() if policy is None else policy  # which request next, whom to preempt
        self._parked: list[Request] = []  # preempted with samples in flight: wait for them
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0  # all, for KV blocks or for priority
        self.num_priority_preemptions = 0
        self._num_added = 0
        self._scoring: set[Request] = set()  # requests holding prompt logprobs not yet sent
        p = self.policy
        self.lora = LoraSeats(max_loras, lora_ready) if max_loras else None
        self.admission = Admission(self.rb, self.blocks, self.slots, p, self.prefix, max_num_seqs,
                                   self.lora)  # fmt: skip
        slide = WindowRelease(window, self.blocks, self.rb, self.prefix) if window else None
        self.spec_cost = SpecCost(*(step_costs or ([], [])))
        self.planner = Planner(
            self.rb, self.blocks, self.slots, p, max_num_batched_tokens, self.preempt, slide,
            self.spec_cost,
        )  # fmt: skip
        eos = np.asarray(eos_token_ids, np.int64)
        self.applier = Applier(self.rb, p, eos, self._scoring, self._sample_off_slot)

    @property
    def num_queried_tokens(self) -> int:
        """Prompt tokens looked up in the prefix cache, over every admission."""
        return self.prefix.num_queried_tokens

    @property
    def num_hit_tokens(self) -> int:
        """Of which found cached."""
        return self.prefix.num_hit_tokens

    # ------------------------------------------------------------------ requests in and out

    def add_request(self, msg: AddRequest) -> Request:
        self._num_added += 1
        req = Request(msg, self.rb, self._num_added)
        assert req.request_id not in self.requests, f"duplicate request id {req.request_id}"
        req.tenant_id = self.policy.tenant_id(req.tenant)
        method = "prediction" if msg.prediction else self.speculative
        # why not a constrained row: its drafts would have to pass the grammar's matcher too;
        # nor a pooling one: it samples nothing
        if method != "off" and msg.params.grammar is None and msg.params.pooling is None:
            req.draft_method, req.spec_k = method, self.num_speculative_tokens
        if msg.block_hashes and self.prefix.takes(req):
            assert len(msg.block_hashes) <= req.num_prompt // self.blocks.block_size
            req.block_hashes = msg.block_hashes
        self.requests[req.request_id] = req
        self.policy.add(req)
        if req.prompt_logprobs is not None:
            self._scoring.add(req)
        return req

    def waiting_requests(self) -> Iterator[Request]:
        """Requests waiting for a seat (preempted ones included), in no particular order."""
        yield from self.policy
        yield from self._parked
        if self.lora is not None:
            yield from self.lora.waiting()

    @property
    def waiting(self) -> list[Request]:
        """Requests waiting for a seat, in arrival order (preempted ones included)."""
        return sorted(self.waiting_requests(), key=lambda r: r.seq)

    @property
    def num_waiting(self) -> int:
        held = self.lora.num_held if self.lora is not None else 0
        return len(self.policy) + len(self._parked) + held

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.policy or self._parked)

    def fits_ever(self, req: Request) -> str | None:
        """Why a request could never run on this engine, or None."""
        if req.num_prompt >= self.max_model_len:
            return f"the prompt has {req.num_prompt} tokens; the context holds {self.max_model_len}"
        if self.blocks.blocks_for(req.limit) > self.blocks.num_usable:
            return (
                f"the request needs {req.limit} tokens of KV cache but the engine holds "
                f"{self.blocks.num_usable * self.blocks.block_size}"
            )
        return None

    def finish(self, req: Request, reason: str) -> bool:
        """End a request and free what it holds; False if it had already ended."""
        if req.finished:
            return False
        if req.status is Status.RUNNING:
            self._leave_slot(req)
            # its samples still in flight are dropped, never charged: uncommit them too
            self.policy.on_leave(req, req.limit - req.num_prompt - len(req.output_ids))
        elif req in self._parked:
            self._parked.remove(req)
        elif self.lora is not None and self.lora.unhold(req):
            pass
        else:
            self.policy.remove(req)
        req.status = Status.FINISHED
        if self.lora is not None:
            self.lora.finished(req)
        self._scoring.discard(req)
        if req.num_pending == 0:
            del self.requests[req.request_id]
        return True

    def preempt(self, req: Request) -> None:
        """Free a running request's KV and slot; it recomputes later from its place in line,
        once the samples still in flight for it have arrived."""
        self._leave_slot(req)
        self.policy.on_leave(req, req.limit - req.num_tokens)  # in flight: charged on arrival
        req.status = Status.WAITING
        self.num_preemptions += 1
        if req.num_pending:
            self._parked.append(req)
        else:
            self.policy.add(req)

    def _leave_slot(self, req: Request) -> None:
        slot = req.slot
        computed, freed = int(self.rb.computed[slot]), int(self.rb.num_freed[slot])
        self.rb.release(slot)  # first: its output ids are a list on it from here
        if self.lora is not None:
            self.lora.left(req)
        self.prefix.leave(req, computed, freed)
        if freed:  # its first blocks went back already (out of a window)
            self.blocks.free(req.blocks[freed:], max(req.num_named - freed, 0))
        else:
            self.blocks.free(req.blocks, req.num_named)
        req.blocks = []
        self.slots.free(slot)

    def _sample_off_slot(self, req: Request, token: int) -> bool:
        """A sample of a request that left its slot since the step was planned: a finished
        one's extra token is dropped (False); a preempted one keeps it (its recompute feeds
        it) and rejoins the queue once nothing is in flight for it."""
        if req.finished:
            req.drop_off_slot()
            if req.num_pending == 0:
                del self.requests[req.request_id]
            return False
        req.apply_off_slot(token)
        self.policy.charge_outputs(np.asarray([req.tenant_id]))
        if req.num_pending == 0:
            self._parked.remove(req)
            self.policy.add(req)
        return True

    # ------------------------------------------------------------------ the two-method contract

    def schedule(self) -> ScheduledStep | None:
        if self.lora is not None and self.lora.held:
            for req in self.lora.release():  # their adapter may take a seat again
                self.policy.add(req)
        if self.policy.ranks_by_priority:
            self._preempt_for_priority()
        if self.running and not (self.policy and len(self.running) < self.max_num_seqs):
            # nobody can take a seat: all may decode
            step = self.planner.plan_decode(self.rb.rows())
            if step is not None:
                return step
        planner = self.planner
        slots, take, draft = planner.plan_running()
        whole = len(slots) == len(self.running)  # every running request is an entry, in order
        budget = self.max_num_batched_tokens - int(take.sum() + draft.sum())
        new_slots, adm_slots, adm_take = self.admission.admit(budget)
        if new_slots:
            slots, take = np.concatenate([slots, adm_slots]), np.concatenate([take, adm_take])
            draft = np.concatenate([draft, np.zeros(len(adm_slots), np.int64)])
        freed = self.slots.take_freed()
        if not len(slots) and not freed:
            return None
        rows = self.rb.rows() if whole and not new_slots else None
        return planner.build(slots, take, new_slots, freed, self.admission.num_cached, rows, draft)

    def _preempt_for_priority(self) -> None:
        """While the next waiting request outranks a running one and lacks a seat or the KV
        blocks of its first chunk, preempt the running request the policy gives up first."""
        while self.running and (nxt := self.policy.peek()) is not None:
            first_chunk = min(nxt.num_tokens, self.max_num_batched_tokens)
            has_seat = len(self.running) < self.max_num_seqs
            if has_seat and self.blocks.can_allocate(self.blocks.blocks_for(first_chunk)):
                return
            # why the array first: a full engine with a queue comes here every step, and the
            # policy's victim is a Python max over the batch; a request can only outrank one
            # of a higher priority number
            if nxt.priority >= self.rb.rows().priority.max():
                return
            victim = self.policy.victim(self.running)
            if not self.policy.outranks(nxt, victim):
                return
            self.preempt(victim)
            self.num_priority_preemptions += 1

    def update_from_output(self, step: ScheduledStep, result: StepResult) -> StepOutput:
        """Append sampled ids, check stops and length for the whole batch, finish what ended."""
        out, ended = self.applier.apply(step, result)
        if result.num_drafted:
            drafted = np.asarray(result.num_drafted, np.int64)
            self.spec_cost.observe(drafted, np.asarray(result.counts, np.int64) - 1)
        for j in np.flatnonzero(ended).tolist():
            self.finish(out.requests[j], out.end_reasons[j])
        return out
