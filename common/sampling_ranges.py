"""Every sampling field's allowed range, written once. The frontend's checks of a request
(frontend/api/params.py), the core's and the runner's checks of what they receive
(common/checks.py) and the OpenAPI document (frontend/api/openapi.py) all read it here.

A range includes its ends unless `low_open`; None is no bound. The ranges that follow the
running config (n, the output budget, logprobs) come from functions of it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gapless.common.config import EngineConfig

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


@dataclass(frozen=True)
class Range:
    low: int | float | None = None
    high: int | float | None = None
    low_open: bool = False  # low itself is outside

    def __contains__(self, value: int | float) -> bool:
        if isinstance(value, float) and not math.isfinite(value):
            return False
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or value <= self.high

    def interval(self) -> str:
        """`[0.0, 2.0]`, `(0.0, 1.0]`: as an error message quotes a float field's range."""
        assert self.low is not None and self.high is not None, self
        return f"{'(' if self.low_open else '['}{float(self.low)}, {float(self.high)}]"

    def json_schema(self) -> dict[str, int | float]:
        """The range as JSON Schema's number keywords."""
        out: dict[str, int | float] = {}
        if self.low is not None:
            out["exclusiveMinimum" if self.low_open else "minimum"] = self.low
        if self.high is not None:
            out["maximum"] = self.high
        return out


# SamplingParams' float fields, by their name in the request and in SamplingParams
FLOAT_RANGES = {
    "temperature": Range(0, 2),
    "top_p": Range(0, 1, low_open=True),
    "min_p": Range(0, 1),
    "presence_penalty": Range(-2, 2),
    "frequency_penalty": Range(-2, 2),
    "repetition_penalty": Range(0, 10, low_open=True),
}
LOGIT_BIAS = Range(-100, 100)  # each entry's bias
TOP_K = Range(-1)  # as a request gives it: -1 and 0 are off, and so is any k past the vocabulary
SEED = Range(INT64_MIN, INT64_MAX)
MIN_TOKENS = Range(0)


def n_range(config: EngineConfig) -> Range:
    return Range(1, config.max_n)


def max_tokens_range(config: EngineConfig) -> Range:
    """The output budget as asked (max_tokens, max_completion_tokens), before the prompt is
    known; with the prompt it must also fit the context."""
    return Range(1, config.model.max_model_len)


def logprobs_range(config: EngineConfig) -> Range:
    """logprobs, top_logprobs and prompt_logprobs: how many alternatives per token."""
    return Range(0, config.max_logprobs)


def sampling_ranges(config: EngineConfig) -> dict[str, Range]:
    """Every sampling field's range, by its name in a request."""
    budget, logprobs = max_tokens_range(config), logprobs_range(config)
    return {
        **FLOAT_RANGES,
        "top_k": TOP_K,
        "seed": SEED,
        "min_tokens": MIN_TOKENS,
        "n": n_range(config),
        "max_tokens": budget,
        "max_completion_tokens": budget,
        "logprobs": logprobs,
        "top_logprobs": logprobs,
    }
