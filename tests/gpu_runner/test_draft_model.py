"""`--speculative draft` on the cpu device, in process (float32, tiny random models): a draft
model of different weights gives greedy tokens equal to speculation off, beside sampled rows
(seeded, temperature 0.8) that keep max_tokens, a stop id and allowed_token_ids; the model
drafting for itself has every draft accepted; a LoRA row drafts with the base draft and keeps
its adapter's tokens; a constrained row does not draft; sim loads no draft model; what is
refused at start."""

from __future__ import annotations

import json
import re
import shutil

import msgspec
import pytest
from prometheus_client import CollectorRegistry

from gapless.common.messages import SamplingParams
from gapless.common.model_files import resolve_model
from gapless.core.metrics import CoreMetrics
from gapless.gpu_runner.draft_model import DraftModel
from tests.conftest import build_tiny_llama, sim_config
from tests.engine_harness import Harness, make_config

BASE = [301, 302, 303, 304, 305, 306, 307, 308, 309, 310, 311, 312]
PROMPTS = [BASE * 3, [5, 6, 7, 8] * 6 + BASE, list(range(400, 440))]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def pair(tmp_path_factory, default_gguf, tiny_model_dir):
    """(target, draft) directories: the tiny random Llama, and one of other weights with its
    own output layer (most of its drafts are rejected)."""
    out = tmp_path_factory.mktemp("draft-model")
    draft = build_tiny_llama(out, default_gguf, seed=5, tie_word_embeddings=False)
    return tiny_model_dir, draft


def _run(target, draft=None, sampled=None, lora=None, prompts=PROMPTS, **overrides):
    """Every prompt greedy through one engine, beside `sampled` ({id: (prompt, params)});
    (harness, drafted, accepted) of the draft method."""
    spec = {"speculative": "off"}
    if draft is not None:
        spec = dict(speculative="draft", draft_model=resolve_model(str(draft)),
                    num_speculative_tokens=3)  # fmt: skip
    cfg = make_config(target, max_num_seqs=4, max_num_batched_tokens=64, **spec, **overrides)
    registry = CollectorRegistry()
    h = Harness(cfg, metrics=CoreMetrics(registry=registry))
    for i, prompt in enumerate(prompts):
        h.add(str(i), prompt, SamplingParams(max_tokens=MAX_TOKENS), lora=lora or "")
    for rid, (prompt, params) in (sampled or {}).items():
        h.add(rid, prompt, params)
    h.run()
    counts = [
        registry.get_sample_value(f"gapless_spec_{name}_tokens_total", {"method": "draft"}) or 0
        for name in ("draft", "accepted")
    ]
    return h, *counts


@pytest.fixture(scope="module")
def off(pair):
    return _run(pair[0])[0]


def test_a_draft_model_of_other_weights_gives_greedy_the_tokens_of_off(pair, off, monkeypatch):
    """Greedy rows beside sampled ones (seeded, temperature 0.8): the greedy tokens are
    off's. On s0, drafts that mostly fall outside allowed_token_ids (rejected, then drawn
    from the residual): every token allowed, the stop id ends the output, max_tokens holds."""
    allowed, stop = (1000, 2000, 3000), 3000
    rules = SamplingParams(max_tokens=12, temperature=0.8, seed=7, stop_token_ids=(stop,),
                           allowed_token_ids=allowed)  # fmt: skip
    sampled = {"s0": (PROMPTS[0], rules)}
    for i in (1, 2):
        sampled[f"s{i}"] = (PROMPTS[i], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8,
                                                       seed=100 + i))  # fmt: skip
    sampled_drafts = []  # q of each sampled row's drafts: verified by rejection sampling
    propose = DraftModel.propose

    def counted(self, *args):
        ids, qs = propose(self, *args)
        sampled_drafts.extend(q for q in qs if q is not None)
        return ids, qs

    monkeypatch.setattr(DraftModel, "propose", counted)
    h, drafted, accepted = _run(*pair, sampled=sampled)
    assert sampled_drafts
    assert {rid: h.outputs[rid] for rid in off.outputs} == off.outputs
    assert 0 < drafted and accepted < drafted
    assert (h.scheduler.rb.spec_extra == 0).all()
    ids = h.outputs["s0"]
    assert 0 < len(ids) <= 12 and set(ids) <= set(allowed) and stop not in ids[:-1]
    assert h.finish["s0"] == ("stop_token" if ids[-1] == stop else "length")
    assert h.finish["s0"] == "stop_token" or len(ids) == 12
    assert len(h.outputs["s1"]) == len(h.outputs["s2"]) == MAX_TOKENS


def test_the_model_drafting_for_itself_is_always_accepted(pair, off):
    h, drafted, accepted = _run(pair[0], pair[0])
    assert h.outputs == off.outputs
    assert drafted > 0 and accepted == drafted
    assert h.steps < off.steps * 0.6


def test_a_lora_row_drafts_with_the_base_draft_and_keeps_its_adapter(pair, tmp_path):
    """The draft model runs no adapter; the verify does, so the tokens are the adapter's."""
    pytest.importorskip("peft")
    import transformers

    from tests.lora_adapters import make_adapter

    base = transformers.LlamaForCausalLM.from_pretrained(pair[0])
    make_adapter(base, "llama", tmp_path / "a", "plain", 0)
    lora = {"lora_modules": {"a": str(tmp_path / "a")}}
    plain = _run(pair[0], lora="a", prompts=PROMPTS[:1], **lora)[0]
    h, drafted, _ = _run(*pair, lora="a", prompts=PROMPTS[:1], **lora)
    assert drafted > 0 and h.outputs == plain.outputs


def test_what_draft_refuses_at_start_names_the_flag(pair, tmp_path):
    """No draft model, a path that is not there, another vocabulary, cuda, tensor
    parallelism, a draft model without the method; and the draft model resolved when fine."""
    from gapless.launch.speculative_config import check_draft_model

    other = tmp_path / "other-vocab"
    shutil.copytree(pair[1], other)
    tokenizer = json.loads((other / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    vocab["hello"], vocab["world"] = vocab["world"], vocab["hello"]
    (other / "tokenizer.json").write_text(json.dumps(tokenizer))
    cfg = make_config(pair[0], speculative="draft", speculative_model=str(pair[1]))
    assert check_draft_model(cfg).draft_model == resolve_model(str(pair[1]))
    bad = {
        "--speculative draft needs --speculative-model PATH": dict(speculative_model=None),
        f"--speculative-model {tmp_path / 'none'}: no such file": dict(
            speculative_model=str(tmp_path / "none")
        ),
        "its tokenizer maps tokens to other ids than the model's (first: ('hello'": dict(
            speculative_model=str(other)
        ),
        "--speculative draft runs on --device cpu and sim, not cuda": dict(device="cuda"),
        "not available with --tensor-parallel-size": dict(tensor_parallel_size=2),
        "--speculative-model is the draft model of --speculative draft (not ngram)": dict(
            speculative="ngram"
        ),
    }
    for error, change in bad.items():
        with pytest.raises(ValueError, match=re.escape(error)):
            check_draft_model(msgspec.structs.replace(cfg, **change))


def test_sim_loads_no_draft_model_and_a_constrained_row_does_not_draft(default_gguf):
    """sim verifies its stand-in drafts; a row with a grammar gets no drafts (the core gives
    it none) whatever the method."""
    import llguidance

    grammar = llguidance.LLMatcher.grammar_from_json_schema({"type": "object"})
    cfg = sim_config(default_gguf, speculative="draft", num_speculative_tokens=3,
                     draft_model=resolve_model(str(default_gguf)))  # fmt: skip
    registry = CollectorRegistry()
    h = Harness(cfg, metrics=CoreMetrics(registry=registry))
    assert not hasattr(h.backend, "executor")
    h.add("json", PROMPTS[0], SamplingParams(max_tokens=4, grammar=grammar))
    h.add("a", PROMPTS[0], SamplingParams(max_tokens=16, ignore_eos=True))
    draft = {rid: r.draft_method for rid, r in h.scheduler.requests.items()}
    assert draft == {"json": "", "a": "draft"}
    h.run(aborts={0: ["json"]})
    assert len(h.outputs["a"]) == 16
    assert registry.get_sample_value("gapless_spec_draft_tokens_total", {"method": "draft"})
