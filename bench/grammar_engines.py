"""Compile time and per-token mask cost of the grammar engines gapless could use, on the
default model's tokenizer: `python -m gapless.bench.grammar_engines`.

Measures, for each engine that imports: building its tokenizer view (once per server), compiling
a JSON schema and json_object, and computing the next-token bitmask plus advancing the matcher
along a valid compact JSON answer (the per-token work a constrained row adds).
"""

from __future__ import annotations

import json
import statistics
import time

from gapless.common.model_cache import default_model_path
from gapless.common.model_files import load_tokenizer, resolve_model

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "email": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city", "zip"],
        },
    },
    "required": ["name", "age", "email", "tags", "address"],
    "additionalProperties": False,
}
ANSWER = {
    "name": "Ada Lovelace",
    "age": 36,
    "email": "ada@example.com",
    "tags": ["math", "engines", "poetry"],
    "address": {"city": "London", "zip": "W1"},
}


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1e3


def measure_llguidance(tok_json: str, vocab: int, eos: list[int], ids: list[int]) -> dict:
    import llguidance
    import llguidance.torch as lt

    t0 = time.perf_counter()
    lltok = llguidance.LLTokenizer(tok_json, n_vocab=vocab, eos_token=eos)
    out = {"tokenizer_ms": _ms(t0)}
    opts = {"whitespace_flexible": False}
    t0 = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults=opts)
    matcher = llguidance.LLMatcher(lltok, grammar)
    out["compile_schema_ms"] = _ms(t0)
    t0 = time.perf_counter()
    llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_json_schema({}, defaults=opts))
    out["compile_object_ms"] = _ms(t0)
    mask = lt.allocate_token_bitmask(1, vocab)
    per = []
    for t in ids:
        t0 = time.perf_counter()
        lt.fill_next_token_bitmask(matcher, mask, 0)
        assert matcher.consume_token(t), matcher.get_error()
        per.append(_ms(t0))
    out["mask_ms_median"] = statistics.median(per)
    out["mask_ms_max"] = max(per)
    return out


def measure_xgrammar(tok_json: str, vocab: int, eos: list[int], ids: list[int]) -> dict:
    import xgrammar as xgr

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(_hf(tok_json), vocab_size=vocab, stop_token_ids=eos)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    out = {"tokenizer_ms": _ms(t0)}
    t0 = time.perf_counter()
    compiled = compiler.compile_json_schema(
        json.dumps(SCHEMA), any_whitespace=False, separators=(",", ":")
    )
    out["compile_schema_ms"] = _ms(t0)
    t0 = time.perf_counter()
    compiler.compile_builtin_json_grammar()
    out["compile_object_ms"] = _ms(t0)
    matcher = xgr.GrammarMatcher(compiled)
    mask = xgr.allocate_token_bitmask(1, vocab)
    per = []
    for t in ids:
        t0 = time.perf_counter()
        matcher.fill_next_token_bitmask(mask, 0)
        assert matcher.accept_token(t)
        per.append(_ms(t0))
    out["mask_ms_median"] = statistics.median(per)
    out["mask_ms_max"] = max(per)
    return out


def _hf(tok_json: str):
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(tok_json))


def main() -> None:
    info = resolve_model(str(default_model_path()))
    tok = load_tokenizer(info)
    ids = tok.encode(json.dumps(ANSWER, separators=(",", ":")), add_special_tokens=False).ids
    ids.append(info.eos_token_ids[0])
    tok_json = tok.to_str()
    eos = list(info.eos_token_ids)
    for name, fn in (("llguidance", measure_llguidance), ("xgrammar", measure_xgrammar)):
        try:
            result = fn(tok_json, info.vocab_size, eos, ids)
        except ImportError as exc:
            print(f"{name}: not installed ({exc})")
            continue
        fields = ", ".join(f"{k} {v:.3f}" for k, v in result.items())
        print(f"{name}: {len(ids)} tokens; {fields}")


if __name__ == "__main__":
    main()
