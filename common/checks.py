"""What makes an AddRequest (or a NewSlot's params) impossible, found before any state changes.

The frontend validates every request (frontend/api/params.py) before it sends one; the core holds
each AddRequest to the same contract whoever sent it, and the runner each new slot's params, so
one impossible request ends with an error and never reaches the scheduler's asserts, the
runner's tensors or the detokenizer's tokenizer (common/bad_messages.py).
"""

from __future__ import annotations

import math

from gapless.common.config import MAX_PRIORITY, MIN_PRIORITY, EngineConfig
from gapless.common.messages import AddRequest, SamplingParams
from gapless.common.sampling_ranges import (
    FLOAT_RANGES,
    LOGIT_BIAS,
    MIN_TOKENS,
    SEED,
    logprobs_range,
    max_tokens_range,
)


def request_problem(msg: AddRequest, config: EngineConfig) -> tuple[str, str] | None:
    """(reason, detail) of the first invariant msg breaks, else None. Per request: the prompt's
    ids are scanned once (min and max)."""
    ids = msg.prompt_token_ids
    if not ids:
        return "empty_prompt", "the prompt has no tokens"
    vocab = config.model.vocab_size
    low, high = min(ids), max(ids)
    if low < 0 or high >= vocab:
        bad = low if low < 0 else high
        return "token_out_of_vocab", f"the prompt holds {bad}, outside [0, {vocab})"
    pred = msg.prediction
    if pred and (min(pred) < 0 or max(pred) >= vocab):
        return "token_out_of_vocab", f"the prediction holds an id outside [0, {vocab})"
    if len(pred) > config.model.max_model_len:
        return "prediction_too_long", f"the prediction has {len(pred)} tokens"
    full_blocks = len(ids) // config.block_size
    if len(msg.block_hashes) > full_blocks:
        return "block_hashes", (
            f"{len(msg.block_hashes)} block hashes for a prompt of {full_blocks} full blocks"
        )
    if not MIN_PRIORITY <= msg.priority <= MAX_PRIORITY:
        return "priority_out_of_range", f"priority {msg.priority}"
    if not math.isfinite(msg.arrival_time):
        return "arrival_time", f"arrival time {msg.arrival_time}"
    why = params_problem(msg.params, config)
    if why is not None:
        return "params_out_of_range", why
    return None


def params_problem(p: SamplingParams, config: EngineConfig) -> str | None:
    """What in p is outside the ranges the frontend allows (common/sampling_ranges.py), else
    None."""
    for name, allowed in FLOAT_RANGES.items():
        value = getattr(p, name)
        if value not in allowed:
            return f"{name} {value}"
    # why the low end alone: the frontend fits the budget to the context with the prompt's length
    if p.max_tokens < (max_tokens_range(config).low or 0):
        return f"max_tokens {p.max_tokens}"
    vocab = config.model.vocab_size
    if not 0 <= p.top_k < vocab:  # 0: off; the frontend sends 0 for -1 and for >= vocab
        return f"top_k {p.top_k}"
    if p.min_tokens not in MIN_TOKENS:
        return f"min_tokens {p.min_tokens}"
    if p.seed is not None and p.seed not in SEED:
        return f"seed {p.seed}"
    for name, k in (("logprobs", p.logprobs), ("prompt_logprobs", p.prompt_logprobs)):
        if k is not None and k not in logprobs_range(config):
            return f"{name} {k}"
    for i, bias in p.logit_bias:
        if not (0 <= i < vocab and bias in LOGIT_BIAS):
            return f"logit_bias ({i}, {bias})"
    if p.allowed_token_ids is not None and not p.allowed_token_ids:
        return "allowed_token_ids is empty"
    for name, ids in (
        ("stop_token_ids", p.stop_token_ids),
        ("allowed_token_ids", p.allowed_token_ids or ()),
        *(("bad_words_ids", word) for word in p.bad_words_ids),
    ):
        if not all(0 <= i < vocab for i in ids):
            return f"{name} holds an id outside [0, {vocab})"
    if any(not word for word in p.bad_words_ids):
        return "bad_words_ids holds an empty word"
    return None
