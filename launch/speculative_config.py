"""vLLM's `--speculative-config` JSON, for the methods gapless has, and the checks of
`--speculative draft` at start.

The object's keys set gapless's own flags: `method` sets --speculative (vLLM's `draft_model`
is gapless's `draft`), `model` sets --speculative-model, and `num_speculative_tokens` sets
--num-speculative-tokens; where a flag is given too, the JSON's value wins. vLLM keys that tune
what gapless does not have (EAGLE heads, the draft's own parallelism or quantization, the n-gram
lengths) are refused by name with what gapless does instead, as are unknown keys and methods,
so a command line copied from vLLM never runs with part of it silently dropped.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import msgspec

from gapless.common.config import EngineConfig
from gapless.gpu_runner.speculate import NGRAM_MAX, NGRAM_MIN

METHODS = ("ngram", "suffix", "draft_model")  # what `method` may name
ALIASES = {"draft_model": "draft"}  # vLLM's name -> --speculative's
MAX_TOKENS = 16  # --num-speculative-tokens' bound
# vLLM's keys gapless does not take, and why
NOT_HERE = {
    "draft_tensor_parallel_size": "the draft model runs in the model's runner, unsharded",
    "quantization": "the draft model takes the model's --dtype and --quantization",
    "max_model_len": "the draft model serves the model's context length",
    "revision": "--speculative-model names a local directory, Hub id or .gguf file",
    "code_revision": "gapless runs no remote code",
    "prompt_lookup_max": f"gapless's n-gram lookup tries {NGRAM_MAX} tokens, then {NGRAM_MIN}",
    "prompt_lookup_min": f"gapless's n-gram lookup tries {NGRAM_MAX} tokens, then {NGRAM_MIN}",
    "disable_by_batch_size": "gapless has no such setting",
}
# vLLM's method names gapless does not serve
OTHER_METHODS = ("eagle", "eagle3", "medusa", "mlp_speculator", "mtp")


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
        elif key == "model":
            if not isinstance(value, str) or not value:
                raise argparse.ArgumentTypeError(
                    f"`model` must be a path or Hub id (got {value!r})"
                )
            fields["speculative_model"] = value
        elif key in NOT_HERE:
            raise argparse.ArgumentTypeError(f"key {key!r} is not available: {NOT_HERE[key]}")
        else:
            known = ", ".join(["method", "model", "num_speculative_tokens"])
            raise argparse.ArgumentTypeError(f"unknown key {key!r} (gapless takes {known})")
    if "speculative" not in fields:
        raise argparse.ArgumentTypeError(f"`method` is required: one of {', '.join(METHODS)}")
    return fields


def _method(value: Any) -> str:
    if value in METHODS:
        return ALIASES.get(value, value)
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


def check_draft_model(config: EngineConfig) -> EngineConfig:
    """config with --speculative-model resolved (EngineConfig.draft_model); ValueError naming
    the flag where `draft` cannot run as asked: no draft model, a path that is not there, a
    draft model of another vocabulary, a device or tensor parallelism it does not run on."""
    from gapless.common.model_check import check_model
    from gapless.common.model_files import load_arch, load_tokenizer, model_path, resolve_model

    method, name = config.speculative, config.speculative_model
    if method != "draft":
        if name is not None:
            raise ValueError(
                f"--speculative-model is the draft model of --speculative draft (not {method})"
            )
        return config
    if name is None:
        raise ValueError("--speculative draft needs --speculative-model PATH (the draft model)")
    if config.device == "cuda":
        raise ValueError("--speculative draft runs on --device cpu and sim, not cuda yet")
    if config.tensor_parallel_size > 1:
        raise ValueError("--speculative draft is not available with --tensor-parallel-size yet")
    try:
        path = model_path(name)
    except ValueError:
        raise ValueError(f"--speculative-model {name}: no such file or directory") from None
    check_model(path)
    info = resolve_model(str(path), config.model.max_model_len)
    problem = _vocabulary_problem(config.model, info, load_arch, load_tokenizer)
    if problem:
        raise ValueError(f"--speculative-model {name}: {problem}")
    return msgspec.structs.replace(config, draft_model=info)


def _vocabulary_problem(target, draft, load_arch, load_tokenizer) -> str:
    """Why draft's token ids do not mean target's, or ""."""
    sizes = (load_arch(target).vocab_size, load_arch(draft).vocab_size)
    if sizes[0] != sizes[1]:
        return f"its vocabulary has {sizes[1]} entries, the model's {sizes[0]}"
    vocab = [load_tokenizer(info).get_vocab(with_added_tokens=True) for info in (target, draft)]
    if vocab[0] != vocab[1]:
        differ = sorted(set(vocab[0].items()) ^ set(vocab[1].items()))[:1]
        return f"its tokenizer maps tokens to other ids than the model's (first: {differ[0]})"
    return ""
