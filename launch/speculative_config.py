"""vLLM's `--speculative-config` JSON, for the methods gapless has.

The object's keys set gapless's own flags: `method` sets --speculative, and
`num_speculative_tokens` sets --num-speculative-tokens; where a flag is given too, the JSON's
value wins. vLLM keys that tune what gapless does not have (a draft model, EAGLE heads, the
n-gram lengths) are refused by name with what gapless does instead, as are unknown keys and
methods, so a command line copied from vLLM never runs with part of it silently dropped.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from gapless.gpu_runner.speculate import NGRAM_MAX, NGRAM_MIN

METHODS = ("ngram", "suffix")  # what `method` may name
MAX_TOKENS = 16  # --num-speculative-tokens' bound
# vLLM's keys gapless does not take, and why
NOT_HERE = {
    "model": "gapless has no draft-model method yet",
    "draft_tensor_parallel_size": "gapless has no draft-model method yet",
    "quantization": "gapless has no draft-model method yet",
    "max_model_len": "gapless has no draft-model method yet",
    "revision": "gapless has no draft-model method yet",
    "code_revision": "gapless has no draft-model method yet",
    "prompt_lookup_max": f"gapless's n-gram lookup tries {NGRAM_MAX} tokens, then {NGRAM_MIN}",
    "prompt_lookup_min": f"gapless's n-gram lookup tries {NGRAM_MAX} tokens, then {NGRAM_MIN}",
    "disable_by_batch_size": "gapless has no such setting",
}
# vLLM's method names gapless does not serve
OTHER_METHODS = ("draft_model", "eagle", "eagle3", "medusa", "mlp_speculator", "mtp")


def parse_speculative_config(text: str) -> dict[str, Any]:
    """The EngineConfig fields a `--speculative-config` JSON object sets; ArgumentTypeError
    (argparse names the flag) for anything else."""
    try:
        obj = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(obj, dict):
        example = '{"method": "ngram", "num_speculative_tokens": 4}'
        raise argparse.ArgumentTypeError(f"expected a JSON object, such as '{example}'")
    fields: dict[str, Any] = {}
    for key, value in obj.items():
        if key == "method":
            fields["speculative"] = _method(value)
        elif key == "num_speculative_tokens":
            fields["num_speculative_tokens"] = _count(value)
        elif key in NOT_HERE:
            raise argparse.ArgumentTypeError(f"key {key!r} is not available: {NOT_HERE[key]}")
        else:
            known = ", ".join(["method", "num_speculative_tokens"])
            raise argparse.ArgumentTypeError(f"unknown key {key!r} (gapless takes {known})")
    if "speculative" not in fields:
        raise argparse.ArgumentTypeError(f"`method` is required: one of {', '.join(METHODS)}")
    return fields


def _method(value: Any) -> str:
    if value in METHODS:
        return value
    have = ", ".join(METHODS)
    if value in OTHER_METHODS or (isinstance(value, str) and value.endswith("_mtp")):
        raise argparse.ArgumentTypeError(f"method {value!r} is not available (gapless has {have})")
    raise argparse.ArgumentTypeError(f"unknown method {value!r} (gapless has {have})")


def _count(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_TOKENS:
        raise argparse.ArgumentTypeError(
            f"num_speculative_tokens must be an integer from 0 to {MAX_TOKENS} (got {value!r})"
        )
    return value
