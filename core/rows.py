"""One view of running rows: the per-request fields a step reads row by row, as arrays.

`FIELDS` declares each per-request field once: its dtype and how it is read off a Request.
`RunningBatch` keeps one [num_slots] column per field, filled when a request takes a slot, and
gathers a `Rows` view of any slot set from them; requests off their slots (preempted or
finished with a sample in flight) get the same view read off their Requests. A new
per-request field is one entry here: admit, the gather and the off-slot view all carry it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from gapless.core.request import Request

# name -> (dtype, how it is read off a Request); constant while the request holds a slot
FIELDS: dict[str, tuple[type, Callable[[Request], int]]] = {
    "prompt_len": (np.int64, lambda r: r.num_prompt),
    "limit": (np.int64, lambda r: r.limit),  # length at which sampling stops
    # prompt + min_tokens: a stop token at or below this length ends nothing
    "min_len": (np.int64, lambda r: r.num_prompt + r.params.min_tokens),
    "ignore_eos": (np.bool_, lambda r: r.params.ignore_eos),
    "has_stop_ids": (np.bool_, lambda r: bool(r.params.stop_token_ids)),
    "tenant_id": (np.int64, lambda r: r.tenant_id),  # the scheduling policy's tenant index
    "priority": (np.int64, lambda r: r.priority),  # lower runs sooner
    "spec_k": (np.int64, lambda r: r.spec_k),  # drafted tokens it may verify per step
}


class Rows:
    """Requests in a fixed order, one row each: the Request, its slot and slot epoch (None
    off slots) and every FIELDS entry as an [n] array attribute (`rows.limit`). What is
    derived from them is made on first use and kept, so a view kept across steps pays once."""

    if TYPE_CHECKING:  # the FIELDS columns

        def __getattr__(self, name: str) -> np.ndarray: ...

    def __init__(
        self,
        requests: list[Request],
        slots: np.ndarray | None,
        epochs: np.ndarray | None,
        columns: dict[str, np.ndarray],
    ) -> None:
        self.requests = requests
        self.slots = slots  # [n] int64
        self.epochs = epochs  # [n] int64: each slot's epoch when gathered
        for name, column in columns.items():  # the FIELDS columns, [n] each
            setattr(self, name, column)
        self._slot_list: list[int] | None = None
        self._request_ids: list[str] | None = None
        self._num_prompt_tokens: list[int] | None = None
        self._any_stop_ids: bool | None = None
        self._tenant_counts: np.ndarray | None = None

    @classmethod
    def off_slot(cls, requests: list[Request]) -> Rows:
        """The view of requests that hold no slot, read off each Request."""
        n = len(requests)
        columns = {
            name: np.fromiter((read(r) for r in requests), dtype, n)
            for name, (dtype, read) in FIELDS.items()
        }
        return cls(requests, None, None, columns)

    def __len__(self) -> int:
        return len(self.requests)

    def take(self, rows: np.ndarray) -> Rows:
        """The view of some of these rows: [k] row indices, in the order given."""
        columns = {name: getattr(self, name)[rows] for name in FIELDS}
        return Rows(
            [self.requests[j] for j in rows.tolist()],
            None if self.slots is None else self.slots[rows],
            None if self.epochs is None else self.epochs[rows],
            columns,
        )

    @property
    def slot_list(self) -> list[int]:
        if self._slot_list is None:
            assert self.slots is not None, "requests off their slots have none"
            self._slot_list = self.slots.tolist()
        return self._slot_list

    @property
    def request_ids(self) -> list[str]:
        if self._request_ids is None:
            self._request_ids = [r.request_id for r in self.requests]
        return self._request_ids

    @property
    def num_prompt_tokens(self) -> list[int]:
        if self._num_prompt_tokens is None:
            self._num_prompt_tokens = self.prompt_len.tolist()
        return self._num_prompt_tokens

    @property
    def any_stop_ids(self) -> bool:
        """Whether any row gave stop_token_ids (only then are its Requests read)."""
        if self._any_stop_ids is None:
            self._any_stop_ids = bool(self.has_stop_ids.any())
        return self._any_stop_ids

    def tenant_counts(self, num_tenants: int) -> np.ndarray:
        """[num_tenants] rows per tenant: what one sample for every row charges."""
        counts = self._tenant_counts
        if counts is None or len(counts) != num_tenants:  # first use, or a tenant arrived since
            counts = self._tenant_counts = np.bincount(self.tenant_id, minlength=num_tenants)
        return counts
