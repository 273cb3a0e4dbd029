"""What makes an AddRequest (or a NewSlot's params) impossible, found before any state changes.

The frontend validates every request (frontend/params.py) before it sends one; the core holds
each AddRequest to the same contract whoever sent it, and the runner each new slot's params, so
one impossible request ends with an error and never reaches the scheduler's asserts, the
runner's tensors or the detokenizer's tokenizer (common/bad_messages.py).
"""

from __future__ import annotations

import math

from gapless.common.config import MAX_PRIORITY, MIN_PRIORITY, EngineConfig
from gapless.common.messages import AddRequest, SamplingParams

_INT64 = 2**63
MAX_LOGIT_BIAS = 100.0  # |bias| the frontend allows


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
    """What in p is outside the ranges frontend/params.py allows, else None."""
    floats = (
        ("temperature", p.temperature, 0.0, 2.0, False),
        ("top_p", p.top_p, 0.0, 1.0, True),
        ("min_p", p.min_p, 0.0, 1.0, False),
        ("presence_penalty", p.presence_penalty, -2.0, 2.0, False),
        ("frequency_penalty", p.frequency_penalty, -2.0, 2.0, False),
        ("repetition_penalty", p.repetition_penalty, 0.0, 10.0, True),
    )
    for name, value, low, high, low_open in floats:
        above = low < value if low_open else low <= value
        if not (math.isfinite(value) and above and value <= high):
            return f"{name} {value}"
    if p.max_tokens < 1:
        return f"max_tokens {p.max_tokens}"
    vocab = config.model.vocab_size
    if not 0 <= p.top_k < vocab:  # 0: off; the frontend sends 0 for -1 and for >= vocab
        return f"top_k {p.top_k}"
    if p.min_tokens < 0:
        return f"min_tokens {p.min_tokens}"
    if p.seed is not None and not -_INT64 <= p.seed < _INT64:
        return f"seed {p.seed}"
    for name, k in (("logprobs", p.logprobs), ("prompt_logprobs", p.prompt_logprobs)):
        if k is not None and not 0 <= k <= config.max_logprobs:
            return f"{name} {k}"
    for i, bias in p.logit_bias:
        if not (0 <= i < vocab and math.isfinite(bias) and abs(bias) <= MAX_LOGIT_BIAS):
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
