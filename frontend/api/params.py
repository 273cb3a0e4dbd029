"""From a decoded request to engine SamplingParams, rejecting out-of-range values with a 400."""

from __future__ import annotations

import re
from typing import Any

import msgspec

from gapless.common.config import EngineConfig
from gapless.common.lora import adapter_of
from gapless.common.messages import SamplingParams
from gapless.common.sampling_ranges import (
    FLOAT_RANGES,
    LOGIT_BIAS,
    MIN_TOKENS,
    SEED,
    TOP_K,
    Range,
    logprobs_range,
    max_tokens_range,
    n_range,
)
from gapless.frontend.api.protocol import SamplingFields
from gapless.frontend.http.errors import ApiError, bad_request

_INT64 = 2**63  # seeds wrap within signed 64 bits (per_choice)


def check_model(model: str | None, config: EngineConfig) -> None:
    """404 unless the request names the served model (omitting it is allowed)."""
    if model is not None and model != config.served_model_name:
        raise ApiError(
            404,
            f"the model `{model}` does not exist; this server serves `{config.served_model_name}`",
            param="model",
            code="model_not_found",
        )


def check_adapter_model(
    model: str | None, config: EngineConfig, tenant: str, loaded: list[str] | None = None
) -> str:
    """The LoRA adapter a generation request names ("" : the served model); 404 unless it
    names the served model or an adapter loaded now (`loaded`, None: --lora-modules') that
    its tenant may use (common/lora.py), so another tenant's adapter reads as a model that
    does not exist."""
    lora = adapter_of(model, config, tenant, loaded)
    if lora is None:
        raise ApiError(404, f"the model `{model}` does not exist", param="model",
                       code="model_not_found")  # fmt: skip
    return lora


def _in_range(value: float, allowed: Range, name: str) -> float:
    if value not in allowed:
        raise bad_request(f"{name} must be in {allowed.interval()}, got {value}", param=name)
    return value


MAX_CACHE_SALT_CHARS = 256


def check_cache_salt(salt: str | None) -> str:
    """The request's prefix-cache salt ("" when absent); an empty or long one is a 400."""
    if salt is None:
        return ""
    if not salt or len(salt) > MAX_CACHE_SALT_CHARS:
        raise bad_request(
            f"cache_salt must be 1 to {MAX_CACHE_SALT_CHARS} characters, got {len(salt)}",
            param="cache_salt",
        )
    return salt


def check_n(n: int | None, config: EngineConfig) -> int:
    n = 1 if n is None else n
    allowed = n_range(config)
    if n not in allowed:
        raise bad_request(f"n must be between 1 and {allowed.high}, got {n}", param="n")
    return n


def check_max_tokens(value: int | None, name: str, config: EngineConfig) -> int | None:
    """Range checks that need no prompt; the context check is `resolve_max_tokens`."""
    allowed = max_tokens_range(config)
    if value is not None and value not in allowed:
        raise bad_request(
            f"{name} must be between 1 and the context length ({allowed.high}), got {value}",
            param=name,
        )
    return value


def resolve_max_tokens(
    value: int | None, name: str, prompt_len: int, prompt_param: str, config: EngineConfig
) -> int:
    """The output budget: as asked if it fits the context, else the rest of the context."""
    limit = config.model.max_model_len
    if prompt_len >= limit:
        raise bad_request(
            f"the prompt ({prompt_param}) is {prompt_len} tokens; it must be shorter than "
            f"the context length of {limit} tokens",
            param=prompt_param,
            code="context_length_exceeded",
        )
    if value is None:
        return limit - prompt_len
    if prompt_len + value > limit:
        raise bad_request(
            f"{name} ({value}) plus the prompt ({prompt_len} tokens) exceeds the context "
            f"length of {limit} tokens",
            param=name,
            code="context_length_exceeded",
        )
    return value


def check_logprobs(value: int | None, name: str, config: EngineConfig) -> int | None:
    allowed = logprobs_range(config)
    if value is not None and value not in allowed:
        raise bad_request(f"{name} must be between 0 and {allowed.high}, got {value}", param=name)
    return value


def _stops(stop: str | list[str] | None, config: EngineConfig) -> tuple[str, ...]:
    stops = [stop] if isinstance(stop, str) else list(stop or ())
    if len(stops) > config.max_stop_strings:
        raise bad_request(
            f"stop may hold at most {config.max_stop_strings} strings, got {len(stops)}",
            param="stop",
        )
    if any(not s for s in stops):
        raise bad_request("stop strings must not be empty", param="stop")
    return tuple(stops)


def _stop_token_ids(ids: list[int] | None, config: EngineConfig) -> tuple[int, ...]:
    vocab = config.model.vocab_size
    for i in ids or ():
        if not 0 <= i < vocab:
            raise bad_request(
                f"stop_token_ids holds {i}, outside the vocabulary [0, {vocab})",
                param="stop_token_ids",
            )
    return tuple(ids or ())


def _token_id(value: int, param: str, config: EngineConfig) -> int:
    vocab = config.model.vocab_size
    if not 0 <= value < vocab:
        raise bad_request(
            f"{param} holds {value}, outside the vocabulary [0, {vocab})", param=param
        )
    return value


MAX_LOGIT_BIAS = 300  # entries; OpenAI's own limit
_TOKEN_KEY = re.compile("-?[0-9]+")


def _logit_bias(
    bias: dict[str, float] | None, config: EngineConfig
) -> tuple[tuple[int, float], ...]:
    if not bias:
        return ()
    if len(bias) > MAX_LOGIT_BIAS:
        raise bad_request(
            f"logit_bias may hold at most {MAX_LOGIT_BIAS} entries, got {len(bias)}",
            param="logit_bias",
        )
    out = []
    for key, value in bias.items():
        if not _TOKEN_KEY.fullmatch(key):  # why not isdigit(): it takes "²", which int() refuses
            raise bad_request(f"logit_bias keys are token ids, got {key!r}", param="logit_bias")
        token_id = _token_id(int(key), "logit_bias", config)
        out.append((token_id, _in_range(float(value), LOGIT_BIAS, "logit_bias")))
    return tuple(sorted(out))


def _allowed(ids: list[int] | None, config: EngineConfig) -> tuple[int, ...] | None:
    if ids is None:
        return None
    if not ids:
        raise bad_request("allowed_token_ids must not be empty", param="allowed_token_ids")
    return tuple(sorted({_token_id(i, "allowed_token_ids", config) for i in ids}))


def sampling_fields(
    req: SamplingFields,
    logprobs: int | None,
    config: EngineConfig,
    bad_words_ids: tuple[tuple[int, ...], ...] = (),
) -> dict[str, Any]:
    """Every range check of the shared sampling fields, as SamplingParams' keyword arguments
    but max_tokens (known once the prompt is); logprobs come checked, bad_words come tokenized
    (`Prompter.bad_words_ids`)."""
    given = config.model.sampling_defaults  # generation_config.json's, for fields left out
    top_k = int(given.get("top_k", 0)) if req.top_k is None else req.top_k
    if top_k not in TOP_K:
        raise bad_request(f"top_k must be -1, 0 (off) or positive, got {top_k}", param="top_k")
    seed = req.seed
    if seed is not None and seed not in SEED:
        raise bad_request("seed must fit in a signed 64-bit integer", param="seed")
    f = _float_or
    min_tokens = req.min_tokens or 0
    if min_tokens not in MIN_TOKENS:
        raise bad_request(f"min_tokens must not be negative, got {min_tokens}", param="min_tokens")
    r = FLOAT_RANGES
    return dict(
        temperature=_in_range(
            f(req.temperature, given.get("temperature", 1.0)), r["temperature"], "temperature"
        ),
        top_p=_in_range(f(req.top_p, given.get("top_p", 1.0)), r["top_p"], "top_p"),
        top_k=0 if top_k == -1 or top_k >= config.model.vocab_size else top_k,
        min_p=_in_range(f(req.min_p, given.get("min_p", 0.0)), r["min_p"], "min_p"),
        seed=seed,
        presence_penalty=_in_range(
            f(req.presence_penalty, 0.0), r["presence_penalty"], "presence_penalty"
        ),
        frequency_penalty=_in_range(
            f(req.frequency_penalty, 0.0), r["frequency_penalty"], "frequency_penalty"
        ),
        repetition_penalty=_in_range(
            f(req.repetition_penalty, given.get("repetition_penalty", 1.0)),
            r["repetition_penalty"],
            "repetition_penalty",
        ),
        logprobs=logprobs,
        ignore_eos=req.ignore_eos,
        stop_token_ids=_stop_token_ids(req.stop_token_ids, config),
        stop=_stops(req.stop, config),
        include_stop_str_in_output=req.include_stop_str_in_output,
        skip_special_tokens=req.skip_special_tokens,
        min_tokens=min_tokens,
        logit_bias=_logit_bias(req.logit_bias, config),
        allowed_token_ids=_allowed(req.allowed_token_ids, config),
        bad_words_ids=bad_words_ids,
    )


def sampling_params(
    req: SamplingFields,
    max_tokens: int,
    logprobs: int | None,
    config: EngineConfig,
    bad_words_ids: tuple[tuple[int, ...], ...] = (),
) -> SamplingParams:
    """`sampling_fields` with the output budget: the engine's SamplingParams."""
    fields = sampling_fields(req, logprobs, config, bad_words_ids)
    return SamplingParams(max_tokens=max_tokens, **fields)


def check_min_tokens(min_tokens: int, max_tokens: int, name: str) -> None:
    """min_tokens cannot exceed the output budget."""
    if min_tokens > max_tokens:
        raise bad_request(
            f"min_tokens ({min_tokens}) must not exceed {name} ({max_tokens})",
            param="min_tokens",
        )


def _float_or(value: float | None, default: float) -> float:
    return default if value is None else float(value)


def per_choice(params: SamplingParams, n: int) -> list[SamplingParams]:
    """n copies; choice i samples with seed + i (wrapped to int64) so choices differ."""
    if params.seed is None:
        return [params] * n
    out = []
    for i in range(n):
        seed = (params.seed + i + _INT64) % (2 * _INT64) - _INT64
        out.append(msgspec.structs.replace(params, seed=seed))
    return out
