"""Grammar-constrained rows through the whole engine (EngineCore + cpu runner): constrained
requests give JSON their schema accepts, the others are untouched."""

from __future__ import annotations

import json

import llguidance
import pytest

from gapless.common.grammars import make_tokenizer
from gapless.common.messages import SamplingParams
from gapless.common.model_files import load_tokenizer
from tests.engine_harness import Harness, make_config

SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 9},
        "kind": {"enum": ["red", "green"]},
    },
    "required": ["ok", "n", "kind"],
    "additionalProperties": False,
}
GRAMMAR = llguidance.LLMatcher.grammar_from_json_schema(
    SCHEMA, defaults={"whitespace_flexible": False}
)
PROMPTS = [[5, 6, 7, 8] * 6, [100, 200, 300] * 8, [42] * 20]


def check(text: str) -> dict:
    value = json.loads(text)
    assert set(value) == {"ok", "n", "kind"}
    assert isinstance(value["ok"], bool) and value["n"] in range(10)
    assert value["kind"] in ("red", "green")
    return value


@pytest.mark.parametrize("overlap", [False, True], ids=["no-overlap", "overlap"])
@pytest.mark.parametrize(
    "limits",
    [dict(), dict(max_num_batched_tokens=32, kv_cache_memory=12 * 4096, block_size=4)],
    ids=["roomy", "preempting"],
)
def test_constrained_rows_follow_the_schema(tiny_model_dir, overlap, limits):
    config = make_config(tiny_model_dir, overlap=overlap, **limits)
    tok = load_tokenizer(config.model)
    free = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    json_params = SamplingParams(max_tokens=40, temperature=0.0, grammar=GRAMMAR)
    sampled = SamplingParams(max_tokens=40, temperature=1.0, seed=3, grammar=GRAMMAR)
    alone = Harness(make_config(tiny_model_dir))
    alone.run({0: [("free", PROMPTS[0], free)]})
    h = Harness(config)
    arrivals = {
        0: [("free", PROMPTS[0], free), ("json", PROMPTS[1], json_params)],
        1: [("sampled", PROMPTS[2], sampled)],
    }
    h.run(arrivals)
    assert h.outputs["free"] == alone.outputs["free"]  # the unconstrained row is untouched
    for rid in ("json", "sampled"):
        ids = h.outputs[rid]
        assert h.finish[rid] == "stop_token", (rid, tok.decode(ids))
        check(tok.decode(ids[:-1]))
    if "kv_cache_memory" in limits:
        assert h.scheduler.num_preemptions > 0


def test_out_of_tokens_ends_with_length(tiny_model_dir):
    h = Harness(make_config(tiny_model_dir))
    h.run(
        {0: [("short", PROMPTS[0], SamplingParams(max_tokens=3, temperature=0.0, grammar=GRAMMAR))]}
    )
    assert h.finish["short"] == "length"
    text = load_tokenizer(h.backend.config.model).decode(h.outputs["short"])
    assert text.startswith("{")  # the grammar held: JSON from the first token


def test_sim_constrained_rows_stay_in_the_grammar(default_gguf):
    from tests.conftest import sim_config

    config = sim_config(default_gguf)
    h = Harness(config)
    params = SamplingParams(max_tokens=24, temperature=1.0, grammar=GRAMMAR)
    h.run({0: [("json", [5, 6, 7], params), ("free", [5, 6, 7], SamplingParams(24))]})
    ids = h.outputs["json"]
    tok = load_tokenizer(config.model)
    view = make_tokenizer(tok.to_str(), config.model.vocab_size, config.model.eos_token_ids)
    matcher = llguidance.LLMatcher(view, GRAMMAR)
    assert all(matcher.consume_token(t) for t in ids), tok.decode(ids)
    assert tok.decode(ids).startswith("{")
