"""Counters of running requests as arrays indexed by runner slot, so that planning a decode
step and applying its ids are array operations over the batch instead of per-request Python.

While a request holds a slot these arrays are the truth; its Request object keeps the ids of
its prompt and of the outputs known when it was admitted. Leaving the slot (finish or
preemption) copies the counters back to the Request.
"""

from __future__ import annotations

import numpy as np

from gapless.core.request import Request


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
        self.limit = np.zeros(s, np.int64)  # total length at which sampling stops
        self.max_tokens = np.zeros(s, np.int64)
        self.num_blocks = np.zeros(s, np.int64)
        self.num_sent = np.zeros(s, np.int64)  # blocks the runner already knows
        self.ignore_eos = np.zeros(s, bool)
        self.has_stop_ids = np.zeros(s, bool)
        self.wants_logprobs = np.zeros(s, bool)
        self.out = np.zeros((s, max_model_len), np.int64)  # [slot, output index] ids
        self.max_model_len = max_model_len

    def total(self, slots: np.ndarray) -> np.ndarray:
        """Prompt plus known and pending outputs."""
        return self.prompt_len[slots] + self.out_len[slots] + self.pending[slots]

    def admit(self, req: Request, slot: int) -> None:
        self.req[slot] = req
        self.epoch[slot] += 1
        p, outs = req.num_prompt, req.output_ids
        self.prompt_len[slot] = p
        self.out_len[slot] = len(outs)
        self.out[slot, : len(outs)] = outs
        self.pending[slot] = 0
        self.computed[slot] = 0
        self.prefill_end[slot] = p + len(outs)
        self.limit[slot] = min(p + req.params.max_tokens, self.max_model_len)
        self.max_tokens[slot] = req.params.max_tokens
        self.num_blocks[slot] = 0
        self.num_sent[slot] = 0
        self.ignore_eos[slot] = req.params.ignore_eos
        self.has_stop_ids[slot] = bool(req.params.stop_token_ids)
        self.wants_logprobs[slot] = req.params.logprobs is not None

    def release(self, slot: int) -> Request:
        """The request leaves its slot; its counters go back to the Request."""
        req = self.req[slot]
        assert req is not None, f"slot {slot} released twice"
        n = int(self.out_len[slot])
        req.output_ids = self.out[slot, :n].tolist()
        req.num_pending = int(self.pending[slot])
        req.num_total = req.num_prompt + n + req.num_pending
        req.num_computed = 0
        self.req[slot] = None
        self.epoch[slot] += 1
        return req
