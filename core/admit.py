"""Admission: waiting requests take seats in the policy's order while the step's token budget
and the KV blocks last, each taking what the prefix cache holds of its tokens."""

from __future__ import annotations

import numpy as np

from gapless.common.messages import NewSlot, SamplingParams
from gapless.core.kv_blocks import BlockManager, SlotManager
from gapless.core.lora import LoraSeats
from gapless.core.policy import Policy
from gapless.core.prefix import PrefixCache
from gapless.core.request import Request, Status
from gapless.core.running import RunningBatch


def _has_penalty(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def charge_prompt(policy: Policy, req: Request, end: int) -> None:
    """Charge the prompt tokens below `end` that were never charged: each is charged once,
    when first planned, so a recompute after preemption is free."""
    computed = min(end, req.num_prompt)
    if computed > req.prompt_charged:
        policy.charge_prompt(req, computed - req.prompt_charged)
        req.prompt_charged = computed


class Admission:
    def __init__(
        self,
        rb: RunningBatch,
        blocks: BlockManager,
        slots: SlotManager,
        policy: Policy,
        prefix: PrefixCache,
        max_num_seqs: int,
        lora: LoraSeats | None = None,
    ) -> None:
        self.rb = rb
        self.blocks = blocks
        self.slots = slots
        self.policy = policy
        self.prefix = prefix
        self.max_num_seqs = max_num_seqs
        self.lora = lora  # whose adapter may take a seat; None: no adapters
        self.num_cached = 0  # tokens the last admit found in the prefix cache

    def admit(self, budget: int) -> tuple[list[NewSlot], np.ndarray, np.ndarray]:
        """Seat waiting requests while `budget` tokens and the KV blocks last. Returns the
        runner's new slots and the (slots, tokens) of the admitted entries, in order."""
        new_slots: list[NewSlot] = []
        slots: list[int] = []
        takes: list[int] = []
        policy, running, block_size = self.policy, self.rb.running, self.blocks.block_size
        self.num_cached = 0
        while budget > 0 and len(running) < self.max_num_seqs:
            req = policy.peek()
            if req is None:
                break
            if self.lora is not None and not self.lora.admits(req.lora):
                policy.remove(req)  # why: it must not hold the queue behind it
                self.lora.hold(req)
                continue
            total = req.num_tokens
            # a request whose prompt logprobs are still to come computes its whole prompt:
            # tokens taken from the cache are never scored
            scoring = req.prompt_logprobs is not None
            hit = self.prefix.lookup(req) if self.prefix.takes(req) and not scoring else []
            cached = len(hit) * block_size
            n = min(total - cached, budget)
            nb = self.blocks.blocks_for(cached + n) - len(hit)
            if not self.blocks.can_allocate(nb + self.blocks.num_unreferenced(hit)):
                break
            policy.remove(req)
            policy.on_admit(req, req.limit - total)
            self._seat(req, hit, nb, cached)
            self.prefix.record(total, cached)
            self.num_cached += cached
            new_slots.append(self._new_slot(req, cached))
            slots.append(req.slot)
            takes.append(n)
            budget -= n
            charge_prompt(policy, req, cached + n)  # now, so the next pick in this loop sees it
        return new_slots, np.asarray(slots, np.int64), np.asarray(takes, np.int64)

    def _seat(self, req: Request, hit: list[int], num_new_blocks: int, cached: int) -> None:
        """req takes a slot, the cached blocks it found and num_new_blocks more."""
        req.status = Status.RUNNING
        if not req.started:
            req.num_cached_prompt = min(cached, req.num_prompt)
        req.started = True
        rb = self.rb
        rb.admit(req, self.slots.allocate())
        if self.lora is not None:
            self.lora.seated(req)
        self.blocks.take(hit)
        req.blocks = hit + self.blocks.allocate(num_new_blocks)
        req.num_named = len(hit)
        rb.num_blocks[req.slot] = len(req.blocks)
        rb.computed[req.slot] = cached
        # cached prompt tokens are never charged to the tenant
        req.prompt_charged = max(req.prompt_charged, min(cached, req.num_prompt))
        self.prefix.file_running(req)

    def _new_slot(self, req: Request, cached: int) -> NewSlot:
        """What the runner learns of a request taking a slot."""
        new = NewSlot(
            slot=req.slot,
            params=req.params,
            num_prompt_tokens=req.num_prompt,
            prompt_token_ids=req.prompt_ids if req.prompt_logprobs is not None else [],
            lora=req.lora,
        )
        if cached and (_has_penalty(req.params) or req.spec_k):
            new.cached_ids = req.known_tokens(0, cached)
        if req.spec_k:
            new.draft_method, new.prediction = req.draft_method, req.prediction
            if req.draft_method == "suffix":  # its drafts draw on this tenant's history only
                new.tenant = req.tenant
        return new
