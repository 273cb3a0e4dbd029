"""Continuous batching with one token budget per step, chunked prefill and preemption.

Contract: `schedule() -> ScheduledStep | None` plans the next step assuming every running
request continues; `update_from_output(step, result) -> StepOutput` applies a step's sampled
ids once they arrive. Several steps may be in flight between the two. Running requests'
counters live in arrays indexed by slot (core/running.py), so a decode step is planned and
applied with array operations over the batch. While every running request decodes and nobody
can take a seat, a step is planned from a view of the running set gathered once per change of
the set (`DecodeSet`), and applied with it: the steady state costs a few array operations.

Prefix caching (invariants in core/kv_blocks.py): a request taking a seat takes the longest
cached chain of its tokens and starts computing at the first token past it. A running request
is filed under its first block's hash; a lookup of the same first block registers (offers to
the cache) the blocks that its steps already planned have filled, so a request sharing a
prefix with one still running finds it, and never a block that the step being planned writes.
The rest of its full blocks with known ids are registered when it leaves its slot (finished or
preempted), so a preempted request usually finds its own KV again. The allocator names
registered blocks only when a lookup asks (core/kv_blocks.py). So distinct prompts pay one
probe per lookup and one registration per request for the cache.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from gapless.common.messages import (
    AddRequest,
    NewSlot,
    PromptLogprobs,
    SampleLogprobs,
    SamplingParams,
    StepPlan,
    StepResult,
)
from gapless.core.kv_blocks import BlockManager, SlotManager, chain_hashes, hash_root
from gapless.core.policy import Policy
from gapless.core.request import Request, Status, check_stop
from gapless.core.running import DecodeSet, RunningBatch

_EMPTY = np.zeros(0, np.int64)

log = logging.getLogger("gapless.core")


def _has_penalty(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


@dataclass
class ScheduledStep:
    plan: StepPlan
    sampled: list[Request]  # requests of the entries that sample, in entry order
    sample_slots: np.ndarray = field(default_factory=lambda: _EMPTY)  # [B_s] slots
    sample_epochs: np.ndarray = field(default_factory=lambda: _EMPTY)  # [B_s] slot epochs
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_cached_tokens: int = 0  # tokens admitted requests found in the prefix cache
    num_released: int = 0  # RunningBatch.num_released when planned
    # slot -> the request whose prompt chunk it scores, as planned: its scores are that
    # request's even if it leaves the slot (preempted, another admitted) before they arrive
    scorers: dict[int, Request] = field(default_factory=dict)
    decode: DecodeSet | None = None  # the set whose every row this step samples, in order
    plan_sent: float = 0.0  # perf_counter when the plan left the core
    schedule_s: float = 0.0  # time spent building it


@dataclass
class StepOutput:
    """What a step's result means for the detokenizer: one token per request still live when
    its id arrived, the reason it ended ("" if it goes on), and its logprobs."""

    requests: list[Request] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    end_reasons: list[str] = field(default_factory=list)
    logprobs: list[SampleLogprobs | None] = field(default_factory=list)  # empty: none asked
    # per request: its prompt logprobs, with its first output token; empty: none in this step
    prompt_logprobs: list[PromptLogprobs | None] = field(default_factory=list)
    # per request, when every row of a decode set is in order (else None: read the requests)
    request_ids: list[str] | None = None
    num_prompt_tokens: list[int] | None = None


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
    ) -> None:
        self.blocks = BlockManager(num_blocks, block_size, caching=prefix_caching)
        self.prefix_caching = prefix_caching
        self._model_salt = model_salt
        self._roots: dict[str, bytes] = {}  # cache salt -> hash root
        # running requests by their first block's hash: a lookup of it registers their blocks
        self._running_heads: dict[bytes, list[Request]] = {}
        # prefix cache, over every admission (a recompute after preemption included)
        self.num_queried_tokens = 0  # tokens looked up
        self.num_hit_tokens = 0  # of which found cached
        self.slots = SlotManager(max_num_seqs)
        self.rb = RunningBatch(max_num_seqs, max_model_len)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self._eos = np.asarray(eos_token_ids, np.int64)
        self.policy = Policy() if policy is None else policy  # which request next, whom to preempt
        self._parked: list[Request] = []  # preempted with samples in flight: wait for them
        self.running: list[Request] = []  # admission order; the policy picks whom to preempt
        self._run_slots: np.ndarray | None = None  # slots of `running`, rebuilt on change
        self._decode: DecodeSet | None = None  # of `running` while all decode, rebuilt on change
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0  # all, for KV blocks or for priority
        self.num_priority_preemptions = 0
        self._num_added = 0
        self._seq = 0
        self._num_cached_admitted = 0  # by the last _admit
        self._scoring: set[Request] = set()  # requests holding prompt logprobs not yet sent

    # ------------------------------------------------------------------ requests in and out

    def add_request(self, msg: AddRequest) -> Request:
        self._num_added += 1
        req = Request(msg, self.rb, self._num_added)
        assert req.request_id not in self.requests, f"duplicate request id {req.request_id}"
        req.tenant_id = self.policy.tenant_id(req.tenant)
        if msg.block_hashes and self.prefix_caching:
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

    @property
    def waiting(self) -> list[Request]:
        """Requests waiting for a seat, in arrival order (preempted ones included)."""
        return sorted(self.waiting_requests(), key=lambda r: r.seq)

    @property
    def num_waiting(self) -> int:
        return len(self.policy) + len(self._parked)

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
        else:
            self.policy.remove(req)
        req.status = Status.FINISHED
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
        self.running.remove(req)
        self._run_slots = self._decode = None
        slot = req.slot
        computed = int(self.rb.computed[slot])
        self.rb.release(slot)  # first: its output ids are a list on it from here
        if self.prefix_caching:
            if req.head_hash is not None:
                peers = self._running_heads[req.head_hash]
                if len(peers) == 1:
                    del self._running_heads[req.head_hash]
                else:
                    peers.remove(req)
                req.head_hash = None
            self._register_sent(req, computed)
        self.blocks.free(req.blocks, req.num_named)
        req.blocks = []
        self.slots.free(slot)

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.policy or self._parked)

    # ------------------------------------------------------------------ planning

    def schedule(self) -> ScheduledStep | None:
        if self.policy.ranks_by_priority:
            self._preempt_for_priority()
        if self.running and not (self.policy and len(self.running) < self.max_num_seqs):
            d = self._decode or self._decode_set()  # nobody can take a seat: all may decode
            if d is not None and (step := self._plan_decode(d)) is not None:
                return step
        self._decode = None  # why: the plan below moves counters the set holds (block capacity)
        run_slots, run_take = self._plan_running()
        budget = self.max_num_batched_tokens - int(run_take.sum())
        new_slots, adm_slots, adm_take = self._admit(budget)
        slots = np.concatenate([run_slots, adm_slots]) if len(adm_slots) else run_slots
        take = np.concatenate([run_take, adm_take]) if len(adm_take) else run_take
        freed = self.slots.take_freed()
        if not len(slots) and not freed:
            return None
        return self._build(slots, take, new_slots, freed)

    def _running_slots(self) -> np.ndarray:
        if self._run_slots is None:
            self._run_slots = np.fromiter(
                (r.slot for r in self.running), np.int64, len(self.running)
            )
        return self._run_slots

    def _decode_set(self) -> DecodeSet | None:
        n = len(self.policy.output_tokens)
        rs, bs = self._running_slots(), self.blocks.block_size
        self._decode = self.rb.decode_set(self.running, rs, bs, n)
        return self._decode

    def _plan_decode(self, d: DecodeSet) -> ScheduledStep | None:
        """Every running request feeds its last token and samples one; a request whose blocks
        are full gets one more. None, having changed nothing, if there is nothing to feed or the
        token budget or the blocks run short (the general plan preempts)."""
        rb, slots, sampled = self.rb, d.slots, d.requests
        start, capacity, epochs = rb.computed[slots], d.capacity, d.epochs
        rows = None
        fed = start < d.feed_below
        if not fed.all():  # a request whose last allowed sample is in flight feeds nothing
            rows = np.flatnonzero(fed)
            slots, start, capacity, epochs = slots[rows], start[rows], capacity[rows], epochs[rows]
            sampled = [sampled[i] for i in rows.tolist()]
        n = len(slots)
        full = np.flatnonzero(start >= capacity)  # every block_size steps per request
        if not n or n > self.max_num_batched_tokens or not self.blocks.can_allocate(len(full)):
            return None
        num_new_blocks, new_blocks = [0] * n, []
        if len(full):
            new_blocks = self.blocks.allocate(len(full))
            for j, block in zip(full.tolist(), new_blocks, strict=True):
                sampled[j].blocks.append(block)
                num_new_blocks[j] = 1
            grown = slots[full]
            rb.num_blocks[grown] += 1
            rb.num_sent[grown] += 1
            d.capacity[full if rows is None else rows[full]] += self.blocks.block_size
        rb.computed[slots] = start + 1
        rb.pending[slots] += 1
        self._seq += 1
        plan = StepPlan(
            seq=self._seq,
            new_slots=[],
            freed_slots=self.slots.take_freed(),
            slots=d.slot_list if rows is None else slots.tolist(),
            num_tokens=[1] * n,
            start_pos=start.tolist(),
            has_tokens=[False] * n,
            token_ids=[],
            sample=[True] * n,
            num_new_blocks=num_new_blocks,
            new_blocks=new_blocks,
        )
        return ScheduledStep(
            plan=plan,
            sampled=sampled,
            sample_slots=slots,
            sample_epochs=epochs,
            num_decode_tokens=n,
            num_released=rb.num_released,
            decode=d if rows is None else None,
        )

    def _plan_running(self) -> tuple[np.ndarray, np.ndarray]:
        """Tokens each running request feeds this step, preempting the newest while the KV
        blocks they need are not there. Returns (slots, tokens) of the entries, oldest first."""
        rb, bs = self.rb, self.blocks.block_size
        while self.running:
            rs = self._running_slots()
            total, comp = rb.num_tokens(rs), rb.computed[rs]
            need = total - comp
            # a request whose last allowed sample is in flight feeds nothing until it finishes
            need[(need == 1) & (total >= rb.limit[rs])] = 0
            before = np.cumsum(need) - need
            take = np.clip(self.max_num_batched_tokens - before, 0, need)
            grow = np.maximum(-(-(comp + take) // bs) - rb.num_blocks[rs], 0)
            if self.blocks.can_allocate(int(grow.sum())):
                for j in np.flatnonzero(grow):
                    req = self.running[j]
                    req.blocks.extend(self.blocks.allocate(int(grow[j])))
                rb.num_blocks[rs] += grow
                keep = take > 0
                return rs[keep], take[keep]
            self.preempt(self.policy.victim(self.running))
        return _EMPTY, _EMPTY

    def _preempt_for_priority(self) -> None:
        """While the next waiting request outranks a running one and lacks a seat or the KV
        blocks of its first chunk, preempt the running request the policy gives up first."""
        while self.running and (nxt := self.policy.peek()) is not None:
            first_chunk = min(nxt.num_tokens, self.max_num_batched_tokens)
            has_seat = len(self.running) < self.max_num_seqs
            if has_seat and self.blocks.can_allocate(self.blocks.blocks_for(first_chunk)):
                return
            # why the array first: a full engine with a queue comes here every step, and the
            # policy's victim is a Python max over the batch (~20 us at 256); a request can only
            # outrank one of a higher priority number
            if nxt.priority >= self.rb.priority[self._running_slots()].max():
                return
            victim = self.policy.victim(self.running)
            if not self.policy.outranks(nxt, victim):
                return
            self.preempt(victim)
            self.num_priority_preemptions += 1

    def _admit(self, budget: int) -> tuple[list[NewSlot], np.ndarray, np.ndarray]:
        """Waiting requests take seats in the policy's order while the budget and KV blocks
        last."""
        new_slots: list[NewSlot] = []
        slots: list[int] = []
        takes: list[int] = []
        policy = self.policy
        num_cached = 0
        while budget > 0 and len(self.running) < self.max_num_seqs:
            req = policy.peek()
            if req is None:
                break
            total = req.num_tokens
            # a request whose prompt logprobs are still to come computes its whole prompt:
            # tokens taken from the cache are never scored
            scoring = req.prompt_logprobs is not None
            hit = self._lookup(req) if self.prefix_caching and not scoring else []
            cached = len(hit) * self.blocks.block_size
            n = min(total - cached, budget)
            nb = self.blocks.blocks_for(cached + n) - len(hit)
            if not self.blocks.can_allocate(nb + self.blocks.num_unreferenced(hit)):
                break
            policy.remove(req)
            policy.on_admit(req, req.limit - total)
            req.status = Status.RUNNING
            if not req.started:
                req.num_cached_prompt = min(cached, req.num_prompt)
            req.started = True
            self.rb.admit(req, self.slots.allocate())
            self.blocks.take(hit)
            req.blocks = hit + self.blocks.allocate(nb)
            req.num_named = len(hit)
            self.rb.num_blocks[req.slot] = len(req.blocks)
            self.rb.computed[req.slot] = cached
            # cached prompt tokens are never charged to the tenant
            req.prompt_charged = max(req.prompt_charged, min(cached, req.num_prompt))
            self.num_queried_tokens += total
            self.num_hit_tokens += cached
            num_cached += cached
            self.running.append(req)
            self._run_slots = self._decode = None
            if req.block_hashes and self.prefix_caching:
                req.head_hash = head = req.block_hashes[0]
                peers = self._running_heads.get(head)
                if peers is None:
                    self._running_heads[head] = [req]
                else:
                    peers.append(req)
            new = NewSlot(
                slot=req.slot,
                params=req.params,
                num_prompt_tokens=req.num_prompt,
                prompt_token_ids=req.prompt_ids if req.prompt_logprobs is not None else [],
            )
            if cached and _has_penalty(req.params):
                new.cached_ids = req.known_tokens(0, cached)
            new_slots.append(new)
            slots.append(req.slot)
            takes.append(n)
            budget -= n
            self._charge_prompt(req, cached + n)  # now, so the next pick in this loop sees it
        self._num_cached_admitted = num_cached
        return new_slots, np.asarray(slots, np.int64), np.asarray(takes, np.int64)

    def _lookup(self, req: Request) -> list[int]:
        """Blocks of the longest cached prefix a request may take: at most (tokens - 1) //
        block size, so that it computes at least its last token (kv_blocks invariant 4)."""
        bs = self.blocks.block_size
        hashes = req.block_hashes
        if hashes:
            head = hashes[0]
        elif req.num_tokens > bs:
            # why the first block alone first: a miss there (the common case with no sharing)
            # then costs one sha256, not the whole prompt's hashing
            head = self._hashes(req, 1)[0]
        else:
            return []
        running = self._running_heads.get(head)
        if running is not None:
            for peer in running:
                self._register_sent(peer, int(self.rb.computed[peer.slot]))
        if not self.blocks.has_head(head):  # with the frontend's hashes: one dict probe
            return []
        max_blocks = (req.num_tokens - 1) // bs
        return self.blocks.lookup(self._hashes(req, max_blocks)[:max_blocks])

    def _register_sent(self, req: Request, computed: int) -> None:
        """Register a request's full blocks that the steps planned so far (all sent), having
        computed this many tokens, have filled and whose ids are known, past those it
        registered before. Those the frontend's prompt hashes cover go with their hashes; the
        rest (outputs) with their tokens, hashed only if a lookup ever asks (kv_blocks: lazy
        names)."""
        bs = self.blocks.block_size
        known = min(computed, len(req.prompt_ids) + len(req.output_ids))
        first, last = req.num_named, min(known // bs, len(req.blocks))
        if last <= first:
            return
        hashes = req.block_hashes
        if len(hashes) < max(first, 1):  # rare: no frontend hashes, or outputs registered before
            hashes = self._hashes(req, max(first, 1))
        k = len(hashes)
        tokens = req.known_tokens(k * bs, last * bs) if k < last else None
        self.blocks.register(req.blocks, first, last, hashes, tokens)
        req.num_named = last

    def _hashes(self, req: Request, n: int) -> list[bytes]:
        """The request's chained block hashes, computed once each, at least n of them (the
        ids of its first n blocks must be known)."""
        hashes = req.block_hashes
        if len(hashes) < n:
            bs = self.blocks.block_size
            if hashes:
                parent = hashes[-1]
            else:
                parent = self._roots.get(req.cache_salt) or self._root(req.cache_salt)
            hashes.extend(chain_hashes(parent, req.known_tokens(len(hashes) * bs, n * bs), bs))
        return hashes

    def _root(self, scope: str) -> bytes:
        """The hash root of a cache scope (AddRequest.cache_salt: the frontend's
        block_hash.cache_scope of tenant and salt), kept for the scopes seen lately."""
        roots = self._roots
        if len(roots) >= 4096:  # why a bound: tenants and salts are the clients' to choose
            roots.clear()
        root = roots[scope] = hash_root(self._model_salt, scope)
        return root

    def _charge_prompt(self, req: Request, end: int) -> None:
        """Charge the prompt tokens below `end` that were never charged: each is charged once,
        when first planned, so a recompute after preemption is free."""
        computed = min(end, req.num_prompt)
        if computed > req.prompt_charged:
            self.policy.charge_prompt(req, computed - req.prompt_charged)
            req.prompt_charged = computed

    def _build(self, slots, take, new_slots, freed) -> ScheduledStep:
        rb = self.rb
        start = rb.computed[slots]
        sample = start + take == rb.num_tokens(slots)
        has_tokens = start < rb.prefill_end[slots]
        token_ids: list[int] = []
        scorers: dict[int, Request] = {}
        for j in np.flatnonzero(has_tokens):  # prompt chunks and recomputes: a few per step
            req = rb.req[slots[j]]
            begin, end = int(start[j]), int(start[j] + take[j])
            token_ids.extend(req.known_tokens(begin, end))
            self._charge_prompt(req, end)
            if req.prompt_logprobs is not None:
                scorers[int(slots[j])] = req
        assert (take[~has_tokens] == 1).all(), "a device-fed entry has one token"
        new_count = rb.num_blocks[slots] - rb.num_sent[slots]
        new_blocks: list[int] = []
        for j in np.flatnonzero(new_count):  # one block per request every block_size steps
            req = rb.req[slots[j]]
            new_blocks.extend(req.blocks[int(rb.num_sent[slots[j]]) :])
        rb.num_sent[slots] = rb.num_blocks[slots]
        rb.computed[slots] += take
        sample_slots = slots[sample]
        rb.pending[sample_slots] += 1
        self._seq += 1
        plan = StepPlan(
            seq=self._seq,
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
        )
        return ScheduledStep(
            plan=plan,
            sampled=[rb.req[s] for s in sample_slots.tolist()],
            sample_slots=sample_slots,
            sample_epochs=rb.epoch[sample_slots].copy(),
            num_prefill_tokens=int(take[has_tokens].sum()),
            num_decode_tokens=int((~has_tokens).sum()),
            num_cached_tokens=self._num_cached_admitted,
            num_released=rb.num_released,
            scorers=scorers,
        )

    # ------------------------------------------------------------------ results

    def update_from_output(self, step: ScheduledStep, result: StepResult) -> StepOutput:
        """Append sampled ids, check stops and length for the whole batch, finish what ended."""
        assert result.seq == step.plan.seq, f"result {result.seq} for plan {step.plan.seq}"
        rb, out = self.rb, StepOutput()
        for piece in result.prompt_logprobs:
            scorer = step.scorers.get(piece.slot)
            if scorer is None:  # never expected: the runner scores the slots the plan names
                log.warning("prompt logprobs for slot %d, which step %d did not score",
                            piece.slot, step.plan.seq)  # fmt: skip
            else:
                scorer.add_prompt_logprobs(piece)
        tokens = np.asarray(result.token_ids, np.int64)
        slots = step.sample_slots
        if rb.num_released == step.num_released:  # no slot changed hands: every row is live
            rows, s, t, requests = None, slots, tokens, list(step.sampled)
        else:
            live = rb.epoch[slots] == step.sample_epochs  # still the same request in that slot
            rows = np.flatnonzero(live)
            s, t = slots[rows], tokens[rows]
            requests = [step.sampled[j] for j in rows.tolist()]
        num_out = rb.append(s, t)
        d = step.decode if rows is None else None
        if d is not None:  # its rows' constants, gathered once for the set
            if len(d.tenant_counts) == len(self.policy.output_tokens):
                self.policy.charge_output_counts(d.tenant_counts)
            else:  # a tenant arrived since: the per-tenant arrays grew
                self.policy.charge_outputs(rb.tenant_id[s])
            reasons, ended = check_stop(
                t,
                d.prompt_len + num_out,
                d.limit,
                d.ignore_eos,
                d.has_stop_ids,
                requests if d.any_stop_ids else [],
                self._eos,
                d.min_len,
            )
        else:
            self.policy.charge_outputs(rb.tenant_id[s])
            has_stop_ids = rb.has_stop_ids[s]
            reasons, ended = check_stop(
                t,
                rb.prompt_len[s] + num_out,
                rb.limit[s],
                rb.ignore_eos[s],
                has_stop_ids,
                requests if has_stop_ids.any() else [],
                self._eos,
                rb.min_len[s],
            )
        if rows is not None and len(rows) < len(slots):  # preempted or finished since planning
            moved = self._apply_moved(step, np.flatnonzero(~live), tokens)
            moved_requests = [step.sampled[j] for j in moved.tolist()]
            moved_reasons, moved_ended = self._check_moved(moved_requests, tokens[moved])
            reasons += moved_reasons
            ended = np.concatenate([ended, moved_ended])
            rows = np.concatenate([rows, moved])
            requests += moved_requests
            t = tokens[rows]
        out.requests, out.token_ids, out.end_reasons = requests, t.tolist(), reasons
        if d is not None:
            out.request_ids, out.num_prompt_tokens = d.request_ids, d.num_prompt_tokens
        if result.logprobs:
            logprobs = result.logprobs
            out.logprobs = list(logprobs) if rows is None else [logprobs[j] for j in rows.tolist()]
        if self._scoring:
            out.prompt_logprobs = [r.take_prompt_logprobs() for r in requests]
            self._scoring.difference_update(requests)
        for j in np.flatnonzero(ended).tolist():
            self.finish(requests[j], reasons[j])
        return out

    def _apply_moved(self, step: ScheduledStep, rows: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        """Rows whose request left its slot since planning. A finished one's extra token is
        dropped; a preempted one keeps it (its recompute will feed it). Returns kept rows."""
        kept = []
        for j in rows.tolist():
            req = step.sampled[j]
            if req.finished:
                req.drop_off_slot()
                if req.num_pending == 0:
                    del self.requests[req.request_id]
            else:
                req.apply_off_slot(int(tokens[j]))
                self.policy.charge_outputs(np.asarray([req.tenant_id]))
                if req.num_pending == 0:
                    self._parked.remove(req)
                    self.policy.add(req)
                kept.append(j)
        return np.asarray(kept, np.int64)

    def _check_moved(
        self, requests: list[Request], tokens: np.ndarray
    ) -> tuple[list[str], np.ndarray]:
        """check_stop over requests off their slots, from their own counters."""
        params = [r.params for r in requests]
        return check_stop(
            tokens,
            np.asarray([r.num_prompt + len(r.output_ids) for r in requests], np.int64),
            np.asarray([r.limit for r in requests], np.int64),
            np.asarray([p.ignore_eos for p in params], bool),
            np.asarray([bool(p.stop_token_ids) for p in params], bool),
            requests,
            self._eos,
            np.asarray([r.num_prompt + r.params.min_tokens for r in requests], np.int64),
        )
