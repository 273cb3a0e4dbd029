"""The table of sampling ranges (common/sampling_ranges.py) is what the frontend's checks, the
core's and runner's checks and the OpenAPI document say (the document: tests/frontend/
test_openapi.py)."""

from __future__ import annotations

import math

import msgspec
import pytest

from gapless.common.checks import params_problem
from gapless.common.config import EngineConfig, ModelInfo
from gapless.common.messages import SamplingParams
from gapless.common.sampling_ranges import (
    FLOAT_RANGES,
    LOGIT_BIAS,
    SEED,
    Range,
    logprobs_range,
    sampling_ranges,
)
from gapless.frontend.api.params import sampling_fields
from gapless.frontend.api.protocol import CompletionRequest
from gapless.frontend.http.errors import ApiError

CONFIG = EngineConfig(
    model=ModelInfo(
        path="m", architecture="llama", vocab_size=100, max_model_len=64, eos_token_ids=(2,)
    ),
    served_model_name="m",
    max_n=3,
    max_logprobs=4,
)


def _ends(allowed: Range) -> list[tuple[float, bool]]:
    """(value, inside) at and just past each end of a float range, and outside any range."""
    assert allowed.low is not None and allowed.high is not None
    low, high = float(allowed.low), float(allowed.high)
    return [
        (low, not allowed.low_open),
        (math.nextafter(low, -math.inf), False),
        (math.nextafter(low, math.inf), True),
        (high, True),
        (math.nextafter(high, math.inf), False),
        (math.nan, False),
        (math.inf, False),
    ]


@pytest.mark.parametrize("name", sorted(FLOAT_RANGES))
def test_the_frontend_and_the_engine_hold_a_float_field_to_the_table(name: str) -> None:
    for value, inside in _ends(FLOAT_RANGES[name]):
        engine_refuses = params_problem(SamplingParams(max_tokens=1, **{name: value}), CONFIG)
        assert (engine_refuses is None) == inside, (name, value, engine_refuses)
        request = msgspec.convert({"prompt": "a", name: value}, CompletionRequest)
        if inside:
            assert sampling_fields(request, None, CONFIG)[name] == value
        else:
            with pytest.raises(ApiError) as refused:
                sampling_fields(request, None, CONFIG)
            assert refused.value.param == name
            assert FLOAT_RANGES[name].interval() in refused.value.message


def test_the_engine_holds_the_other_fields_to_the_table() -> None:
    ok = SamplingParams(max_tokens=1)
    assert params_problem(ok, CONFIG) is None
    assert SEED.low is not None and SEED.high is not None
    for seed, inside in ((SEED.low, True), (SEED.high, True), (SEED.high + 1, False)):
        p = msgspec.structs.replace(ok, seed=seed)
        assert (params_problem(p, CONFIG) is None) == inside, seed
    top = logprobs_range(CONFIG).high
    assert top == CONFIG.max_logprobs
    for k, inside in ((0, True), (top, True), (top + 1, False), (-1, False)):
        p = msgspec.structs.replace(ok, logprobs=k)
        assert (params_problem(p, CONFIG) is None) == inside, k
    for bias, inside in ((LOGIT_BIAS.high, True), (math.nextafter(100.0, 101.0), False)):
        p = msgspec.structs.replace(ok, logit_bias=((5, bias),))
        assert (params_problem(p, CONFIG) is None) == inside, bias
    assert params_problem(msgspec.structs.replace(ok, min_tokens=-1), CONFIG) is not None


def test_the_config_sets_the_ranges_that_follow_it() -> None:
    ranges = sampling_ranges(CONFIG)
    assert ranges["n"] == Range(1, 3)
    assert ranges["max_tokens"] == ranges["max_completion_tokens"] == Range(1, 64)
    assert ranges["logprobs"] == ranges["top_logprobs"] == Range(0, 4)
    assert Range(0, 1, low_open=True).json_schema() == {"exclusiveMinimum": 0, "maximum": 1}
    assert 10**400 not in SEED and 2**63 - 1 in SEED  # no float conversion of big ints
