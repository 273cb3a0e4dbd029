"""What the scheduler hands out per step: the plan with what applying its result needs, and
what a result meant."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from gapless.common.messages import PromptLogprobs, SampleLogprobs, StepPlan
from gapless.core.request import Request
from gapless.core.rows import Rows


@dataclass
class ScheduledStep:
    plan: StepPlan
    rows: Rows  # the entries that sample, in entry order
    drafts: np.ndarray | None = None  # [R] drafts each sampled row may verify; None: none
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_cached_tokens: int = 0  # tokens admitted requests found in the prefix cache
    num_released: int = 0  # RunningBatch.num_released when planned
    # slot -> the request whose prompt chunk it scores, as planned: its scores are that
    # request's even if it leaves the slot (preempted, another admitted) before they arrive
    scorers: dict[int, Request] = field(default_factory=dict)
    decode: Rows | None = None  # the running set the steady-decode plan planned over
    plan_sent: float = 0.0  # perf_counter when the plan left the core
    schedule_s: float = 0.0  # time spent building it

    @property
    def sampled(self) -> list[Request]:
        """Requests of the entries that sample, in entry order."""
        return self.rows.requests


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
    # per request: its pooled vector (an embedding request), b"" for others; empty: none
    embeddings: list[bytes] = field(default_factory=list)
    # per request, when every row of the step was still live (else None: read the requests)
    request_ids: list[str] | None = None
    num_prompt_tokens: list[int] | None = None
    counts: list[int] | None = None  # tokens per request, when a run has more than one
