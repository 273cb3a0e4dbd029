"""A request as the core sees it, and the length at which it ends."""

from __future__ import annotations

from enum import Enum
from typing import TYPE_CHECKING

import numpy as np

from gapless.common.block_hash import adapter_scope
from gapless.common.messages import AddRequest, PromptLogprobs, SamplingParams

if TYPE_CHECKING:
    from gapless.core.running import RunningBatch


class Status(Enum):
    WAITING = 0
    RUNNING = 1
    FINISHED = 2


def length_limit(num_prompt, max_tokens, max_model_len):
    """Total length (prompt + output) at which a request ends by length; ints or arrays."""
    return np.minimum(num_prompt + max_tokens, max_model_len)


class Request:
    """One request's identity, inputs and life. Each fact has one owner: while the request
    holds a batch slot its output ids and counters live in the running batch's arrays
    (core/running.py) and are read through the properties below; off a slot they live here.
    Moving in and out of a slot moves them, so no copy goes stale. The per-request fields a
    step reads row by row (core/rows.py: FIELDS) are read off it when it takes a slot; they do
    not change while it holds one.
    """

    __slots__ = (
        "request_id",
        "frontend_id",
        "prompt_ids",
        "params",
        "arrival_time",
        "tenant",
        "priority",
        "seq",
        "queued_at",
        "tenant_id",
        "prompt_charged",
        "cache_salt",
        "block_hashes",
        "num_cached_prompt",
        "num_named",
        "head_hash",
        "started",
        "limit",
        "status",
        "slot",
        "blocks",
        "_batch",
        "_outputs",
        "_pending",
        "prompt_logprobs",
        "draft_method",
        "prediction",
        "spec_k",
        "lora",
    )

    def __init__(self, msg: AddRequest, batch: RunningBatch, seq: int) -> None:
        self.request_id = msg.request_id
        self.frontend_id = msg.frontend_id
        self.prompt_ids = msg.prompt_token_ids
        self.params: SamplingParams = msg.params
        self.arrival_time = msg.arrival_time  # time.time() at the frontend
        self.tenant = msg.tenant
        self.priority = msg.priority  # lower runs sooner
        self.seq = seq  # arrival order in the core: a request's place in line
        self.queued_at = 0.0  # policy clock when it last joined the waiting queue (Policy.add)
        self.tenant_id = 0  # the policy's index of the tenant
        self.prompt_charged = 0  # prompt tokens charged to the tenant (a recompute is free)
        self.started = False  # got a seat once (a preempted request has)
        self.lora = msg.lora  # the LoRA adapter it runs with; "": the base
        # its adapter is part of its prefix-cache scope (the frontend hashes blocks the same way)
        self.cache_salt = adapter_scope(msg.cache_salt, msg.lora)
        self.block_hashes: list[bytes] = []  # chained hashes of its first full blocks (kv_blocks)
        self.num_cached_prompt = 0  # prompt tokens found in the prefix cache at its first seat
        self.num_named = 0  # leading blocks it holds that were offered to the cache by name
        self.head_hash: bytes | None = None  # its first block's hash while filed as running
        self.limit = int(
            length_limit(len(msg.prompt_token_ids), msg.params.max_tokens, batch.max_model_len)
        )
        self.status = Status.WAITING
        self.slot = -1  # runner slot while RUNNING
        self.blocks: list[int] = []  # KV block ids while RUNNING
        self._batch = batch
        self._outputs: list[int] | None = []  # None while the batch holds them
        self._pending = 0  # samples in steps not yet applied, while off a slot
        # params.prompt_logprobs: scored prompt tokens so far (positions 1..), until sent with the
        # first output token (then None); a recompute's repeats are dropped
        self.prompt_logprobs: PromptLogprobs | None = (
            None if msg.params.prompt_logprobs is None else PromptLogprobs(-1, 1, [], [])
        )
        self.prediction = msg.prediction
        self.draft_method = ""  # the runner's drafter, "" none (Scheduler.add_request sets it)
        self.spec_k = 0  # drafted tokens it may verify per step

    @property
    def num_prompt(self) -> int:
        return len(self.prompt_ids)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def output_ids(self) -> list[int]:
        if self._outputs is None:
            return self._batch.output_ids(self.slot)
        return self._outputs

    @property
    def num_outputs(self) -> int:
        """Output ids known (applied), without building their list."""
        if self._outputs is None:
            return int(self._batch.out_len[self.slot])
        return len(self._outputs)

    @property
    def num_pending(self) -> int:
        """Tokens that steps in flight will sample for this request."""
        if self._outputs is None:
            return int(self._batch.pending[self.slot])
        return self._pending

    @property
    def num_tokens(self) -> int:
        """Prompt, known outputs and pending samples: what a recompute must cover."""
        return self.num_prompt + len(self.output_ids) + self.num_pending

    def known_tokens(self, start: int, end: int) -> list[int]:
        """Prompt and output ids in [start, end): what a (re)prefill chunk feeds."""
        p = len(self.prompt_ids)
        if end <= p:
            return self.prompt_ids[start:end]
        head = self.prompt_ids[start:] if start < p else []
        begin, stop = max(0, start - p), end - p
        if self._outputs is None:  # on a slot: only the slice, not the whole output row
            stop = min(stop, int(self._batch.out_len[self.slot]))
            return head + self._batch.out[self.slot, begin:stop].tolist()
        return head + self._outputs[begin:stop]

    def add_prompt_logprobs(self, piece: PromptLogprobs) -> None:
        """Join one chunk's scores past what is held: a recompute after preemption scores the
        prompt again from its start, in chunks of whatever size its budget allows then."""
        held = self.prompt_logprobs
        if held is None:
            return
        skip = held.start + len(held.token_ids) - piece.start  # of this chunk, held already
        if skip < 0 or skip >= len(piece.token_ids):
            return  # all repeats (or, never expected, a gap: joined, it would shift the rest)
        held.token_ids += piece.token_ids[skip:]
        held.logprobs += piece.logprobs[skip:]

    def take_prompt_logprobs(self) -> PromptLogprobs | None:
        """The prompt's scores, once, when its first output token is sent."""
        held, self.prompt_logprobs = self.prompt_logprobs, None
        return held

    # moving between a slot and the queue: called by RunningBatch only

    def take_off_slot_state(self) -> tuple[list[int], int]:
        outputs, pending = self._outputs, self._pending
        assert outputs is not None, f"{self.request_id} already holds a slot"
        self._outputs, self._pending = None, 0
        return outputs, pending

    def put_off_slot_state(self, outputs: list[int], pending: int) -> None:
        assert self._outputs is None, f"{self.request_id} holds no slot"
        self._outputs, self._pending = outputs, pending

    def apply_off_slot(self, token: int) -> None:
        """A step in flight sampled for this request after it left its slot (preempted)."""
        assert self._outputs is not None and self._pending > 0
        self._pending -= 1
        self._outputs.append(token)

    def drop_off_slot(self) -> None:
        """The one extra token of a request that already ended: dropped."""
        assert self._outputs is not None and self._pending > 0
        self._pending -= 1
