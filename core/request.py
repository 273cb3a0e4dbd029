"""A request's state as the core sees it."""

from __future__ import annotations

from enum import Enum

from gapless.core.common.messages import AddRequest, SamplingParams


class Status(Enum):
    WAITING = 0
    RUNNING = 1
    FINISHED = 2


class Request:
    """A request's ids and identity. Its token counters are kept here only while it is not
    running; a running request's live in core/running.py's arrays, by slot.

    num_total counts prompt tokens plus every output token that is known or that a step in
    flight will produce (num_pending of them).
    """

    __slots__ = (
        "request_id",
        "frontend_id",
        "prompt_ids",
        "output_ids",
        "params",
        "arrival_time",
        "tenant",
        "priority",
        "status",
        "finish_reason",
        "slot",
        "blocks",
        "num_blocks_sent",
        "num_computed",
        "num_total",
        "num_pending",
        "num_preemptions",
        "first_step_time",
        "stop_ids",
        "prefill_end",
    )

    def __init__(self, msg: AddRequest, eos_token_ids: tuple[int, ...]) -> None:
        self.request_id = msg.request_id
        self.frontend_id = msg.frontend_id
        self.prompt_ids = msg.prompt_token_ids
        self.output_ids: list[int] = []
        self.params: SamplingParams = msg.params
        self.arrival_time = msg.arrival_time
        self.tenant = msg.tenant
        self.priority = msg.priority
        self.status = Status.WAITING
        self.finish_reason: str | None = None
        self.slot = -1
        self.blocks: list[int] = []
        self.num_computed = 0
        self.num_total = len(self.prompt_ids)
        self.num_pending = 0  # samples in steps not yet applied
        self.num_preemptions = 0
        self.first_step_time: float | None = None
        ids = set(self.params.stop_token_ids)
        if not self.params.ignore_eos:
            ids.update(eos_token_ids)
        self.stop_ids = frozenset(ids)

    @property
    def num_prompt(self) -> int:
        return len(self.prompt_ids)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def known_tokens(self, start: int, end: int) -> list[int]:
        """Prompt and output ids in [start, end): what a (re)prefill chunk feeds."""
        p = len(self.prompt_ids)
        if end <= p:
            return self.prompt_ids[start:end]
        return (self.prompt_ids[start:] if start < p else []) + self.output_ids[
            max(0, start - p) : end - p
        ]
