"""Running requests' ids and counters as arrays indexed by runner slot, so that planning a
decode step and applying its ids are array operations over the batch.

While a request holds a slot these arrays are the only copy of its output ids and counters
(its Request reads them from here); admit moves them in, release moves them back.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gapless.core.request import Request


@dataclass(eq=False)
class DecodeSet:
    """The running requests while every one of them decodes (feeds its last token, samples
    one): what a decode step reads per row, gathered once per change of the running set, not
    every step. Rows are the running requests in admission order."""

    requests: list[Request]
    request_ids: list[str]  # [n] of requests
    num_prompt_tokens: list[int]  # [n] of requests
    slots: np.ndarray  # [n] int64
    slot_list: list[int]  # [n] the same, for plans
    epochs: np.ndarray  # [n] slot epochs
    capacity: np.ndarray  # [n] tokens its KV blocks hold: a step starting there needs a block
    feed_below: np.ndarray  # [n] limit - 1: computed this far, its last sample is in flight
    prompt_len: np.ndarray  # [n]
    limit: np.ndarray  # [n]
    ignore_eos: np.ndarray  # [n] bool
    min_len: np.ndarray  # [n]
    has_stop_ids: np.ndarray  # [n] bool
    any_stop_ids: bool
    tenant_counts: np.ndarray  # [T] rows per tenant: a full step's charge


class RunningBatch:
    def __init__(self, num_slots: int, max_model_len: int) -> None:
        s = num_slots
        self.req: list[Request | None] = [None] * s
        self.epoch = np.zeros(s, np.int64)  # bumped whenever a slot changes hands
        self.prompt_len = np.zeros(s, np.int64)
        self.out_len = np.zeros(s, np.int64)  # output ids known (applied)
        self.pending = np.zeros(s, np.int64)  # samples in steps not yet applied
        self.computed = np.zeros(s, np.int64)  # tokens whose KV a sent step writes
        self.prefill_end = np.zeros(s, np.int64)  # positions from here on were sampled here
        self.limit = np.zeros(s, np.int64)  # Request.limit: length at which sampling stops
        self.num_blocks = np.zeros(s, np.int64)
        self.num_sent = np.zeros(s, np.int64)  # blocks the runner already knows
        self.ignore_eos = np.zeros(s, bool)
        self.has_stop_ids = np.zeros(s, bool)
        self.min_len = np.zeros(s, np.int64)  # prompt + min_tokens: no stop token ends it before
        self.tenant_id = np.zeros(s, np.int64)  # the scheduling policy's tenant index
        self.priority = np.zeros(s, np.int64)
        self.out = np.zeros((s, max_model_len), np.int64)  # [slot, output index] ids
        self.max_model_len = max_model_len
        self.num_released = 0  # releases so far: none since a step was planned, all rows live

    def num_tokens(self, slots: np.ndarray) -> np.ndarray:
        """Prompt plus known and pending outputs."""
        return self.prompt_len[slots] + self.out_len[slots] + self.pending[slots]

    def output_ids(self, slot: int) -> list[int]:
        return self.out[slot, : self.out_len[slot]].tolist()

    def admit(self, req: Request, slot: int) -> None:
        outputs, pending = req.take_off_slot_state()
        assert pending == 0, "a request with samples in flight cannot take a slot"
        self.req[slot] = req
        req.slot = slot
        self.epoch[slot] += 1
        p, n = req.num_prompt, len(outputs)
        self.prompt_len[slot] = p
        self.out_len[slot] = n
        self.out[slot, :n] = outputs
        self.pending[slot] = 0
        self.computed[slot] = 0
        self.prefill_end[slot] = p + n
        self.limit[slot] = req.limit
        self.num_blocks[slot] = 0
        self.num_sent[slot] = 0
        self.ignore_eos[slot] = req.params.ignore_eos
        self.has_stop_ids[slot] = bool(req.params.stop_token_ids)
        self.min_len[slot] = req.num_prompt + req.params.min_tokens
        self.tenant_id[slot] = req.tenant_id
        self.priority[slot] = req.priority

    def decode_set(
        self, requests: list[Request], slots: np.ndarray, block_size: int, num_tenants: int
    ) -> DecodeSet | None:
        """The running requests' decode view, or None if one of them still prefills (or has
        blocks the runner was not sent)."""
        computed = self.computed[slots]
        if not (self.num_tokens(slots) - computed == 1).all():
            return None
        if not (computed >= self.prefill_end[slots]).all():  # its next token is not on the device
            return None
        num_blocks = self.num_blocks[slots]
        if not (self.num_sent[slots] == num_blocks).all():
            return None
        limit, has_stop_ids = self.limit[slots], self.has_stop_ids[slots]
        return DecodeSet(
            requests=list(requests),
            request_ids=[r.request_id for r in requests],
            num_prompt_tokens=[r.num_prompt for r in requests],
            slots=slots,
            slot_list=slots.tolist(),
            epochs=self.epoch[slots],
            capacity=num_blocks * block_size,
            feed_below=limit - 1,
            prompt_len=self.prompt_len[slots],
            limit=limit,
            ignore_eos=self.ignore_eos[slots],
            min_len=self.min_len[slots],
            has_stop_ids=has_stop_ids,
            any_stop_ids=bool(has_stop_ids.any()),
            tenant_counts=np.bincount(self.tenant_id[slots], minlength=num_tenants),
        )

    def append(self, slots: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        """One sampled id for each slot's request: [R] slots, [R] ids. Returns [R] each one's
        output count with it."""
        n = self.out_len[slots]
        self.out[slots, n] = tokens
        n += 1
        self.out_len[slots] = n
        self.pending[slots] -= 1
        return n

    def release(self, slot: int) -> Request:
        """The request leaves its slot; its ids and pending count go back to the Request."""
        req = self.req[slot]
        assert req is not None, f"slot {slot} released twice"
        req.put_off_slot_state(self.output_ids(slot), int(self.pending[slot]))
        req.slot = -1
        self.req[slot] = None
        self.epoch[slot] += 1
        self.num_released += 1
        return req
