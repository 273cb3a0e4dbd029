"""Running requests' ids and counters as arrays indexed by runner slot, so that planning a
decode step and applying its ids are array operations over the batch.

While a request holds a slot these arrays are the only copy of its output ids and counters
(its Request reads them from here); admit moves them in, release moves them back. The
per-request fields (core/rows.py) are columns filled on admit; `rows()` hands out the running
set's view of them, gathered once per change of the set.
"""

from __future__ import annotations

import numpy as np

from gapless.core.request import Request
from gapless.core.rows import FIELDS, Rows


class RunningBatch:
    def __init__(self, num_slots: int, max_model_len: int, max_seq_len: int) -> None:
        """max_seq_len: tokens one sequence can reach here, the KV cache's bound on
        max_model_len."""
        s = num_slots
        self.req: list[Request | None] = [None] * s
        self.running: list[Request] = []  # admission order; the policy picks whom to preempt
        self.epoch = np.zeros(s, np.int64)  # bumped whenever a slot changes hands
        self.admitted = np.zeros(s, np.int64)  # its request's admission number; 0: free
        self._num_admitted = 0
        # [slot] one column per FIELDS entry
        self.columns = {name: np.zeros(s, dtype) for name, (dtype, _) in FIELDS.items()}
        self._readers = [(self.columns[name], read) for name, (_, read) in FIELDS.items()]
        self.prompt_len = self.columns["prompt_len"]  # the column the counters build on
        self.out_len = np.zeros(s, np.int64)  # output ids known (applied)
        self.pending = np.zeros(s, np.int64)  # samples in steps not yet applied
        self.computed = np.zeros(s, np.int64)  # tokens whose KV a sent step writes
        self.prefill_end = np.zeros(s, np.int64)  # positions from here on were sampled here
        # drafts the steps not yet applied may verify: an upper bound on the tokens they add
        # past `computed` and `pending` (one each), which KV and the length limit reserve
        self.spec_extra = np.zeros(s, np.int64)
        self.num_blocks = np.zeros(s, np.int64)
        self.num_sent = np.zeros(s, np.int64)  # blocks the runner already knows
        # leading blocks given back, out of a sliding window (core/window.py); the runner's
        # table keeps them, so num_blocks and num_sent still count them
        self.num_freed = np.zeros(s, np.int64)
        self.out = np.zeros((s, max_seq_len), np.int64)  # [slot, output index] ids
        self.max_model_len = max_model_len
        self.num_released = 0  # releases so far: none since a step was planned, all rows live
        self._rows: Rows | None = None  # the running set's view, until the set changes

    def rows(self) -> Rows:
        """The running set's view, in admission order, kept until a request takes or leaves
        a slot."""
        rows = self._rows
        if rows is None:
            # why not the requests' slots: a loop over the batch costs several times this
            held = np.flatnonzero(self.admitted)
            slots = held[np.argsort(self.admitted[held])]  # admission order, as `running`
            rows = self._rows = self.gather(slots, list(self.running))
        return rows

    def gather(self, slots: np.ndarray, requests: list[Request] | None = None) -> Rows:
        """A view of these slots' requests: [n] slots (requests: theirs, if at hand)."""
        if requests is None:
            requests = [self.req[s] for s in slots.tolist()]  # type: ignore[misc]
        columns = {name: column[slots] for name, column in self.columns.items()}
        return Rows(requests, slots, self.epoch[slots], columns)

    def num_tokens(self, slots: np.ndarray) -> np.ndarray:
        """Prompt plus known and pending outputs."""
        return self.prompt_len[slots] + self.out_len[slots] + self.pending[slots]

    def decodes_all(self, slots: np.ndarray) -> bool:
        """Whether each of these slots' requests decodes: feeds one token, sampled on the
        device, into blocks the runner was sent."""
        computed = self.computed[slots]
        return bool(
            (self.num_tokens(slots) - computed == 1).all()
            and (computed >= self.prefill_end[slots]).all()
            and (self.num_sent[slots] == self.num_blocks[slots]).all()
        )

    def output_ids(self, slot: int) -> list[int]:
        return self.out[slot, : self.out_len[slot]].tolist()

    def admit(self, req: Request, slot: int) -> None:
        outputs, pending = req.take_off_slot_state()
        assert pending == 0, "a request with samples in flight cannot take a slot"
        self.req[slot] = req
        req.slot = slot
        self.running.append(req)
        self._rows = None
        self._num_admitted += 1
        self.admitted[slot] = self._num_admitted
        self.epoch[slot] += 1
        for column, read in self._readers:
            column[slot] = read(req)
        n = len(outputs)
        self.out_len[slot] = n
        self.out[slot, :n] = outputs
        self.pending[slot] = 0
        self.computed[slot] = 0
        self.prefill_end[slot] = req.num_prompt + n
        self.spec_extra[slot] = 0
        self.num_blocks[slot] = 0
        self.num_sent[slot] = 0
        self.num_freed[slot] = 0

    def append(self, slots: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        """One sampled id for each slot's request: [R] slots, [R] ids. Returns [R] each one's
        output count with it."""
        n = self.out_len[slots]
        self.out[slots, n] = tokens
        n += 1
        self.out_len[slots] = n
        self.pending[slots] -= 1
        return n

    def append_runs(
        self,
        slots: np.ndarray,
        num: np.ndarray,
        row: np.ndarray,
        index: np.ndarray,
        tokens: np.ndarray,
    ) -> None:
        """The accepted drafts of verified runs (their KV, written by the step, now counts as
        computed): num [R] ids after each slot's first, and each id's [P] row, [P] output
        index and [P] value."""
        self.out[slots[row], index] = tokens
        self.out_len[slots] += num
        self.computed[slots] += num

    def release(self, slot: int) -> Request:
        """The request leaves its slot; its ids and pending count go back to the Request."""
        req = self.req[slot]
        assert req is not None, f"slot {slot} released twice"
        self.running.remove(req)
        self._rows = None
        self.admitted[slot] = 0
        req.put_off_slot_state(self.output_ids(slot), int(self.pending[slot]))
        req.slot = -1
        self.req[slot] = None
        self.epoch[slot] += 1
        self.num_released += 1
        return req
