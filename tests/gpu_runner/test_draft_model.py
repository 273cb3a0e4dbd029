"""`--speculative draft` on the cpu device, in process (float32, tiny random models): a draft
model of different weights gives greedy tokens equal to speculation off; the model drafting for
itself has every draft accepted; sampled rows (seeded, temperature 0.8) keep max_tokens, a stop
id and allowed_token_ids; a LoRA row drafts with the base draft and keeps its adapter's tokens;
a constrained row does not draft."""

from __future__ import annotations

import json
import re
import shutil

import msgspec
import pytest
import torch
from prometheus_client import CollectorRegistry

from gapless.common.messages import SamplingParams
from gapless.common.model_files import resolve_model
from gapless.core.metrics import CoreMetrics
from tests.conftest import build_tiny_llama
from tests.engine_harness import Harness, make_config

BASE = [301, 302, 303, 304, 305, 306, 307, 308, 309, 310, 311, 312]
PROMPTS = [BASE * 3, [5, 6, 7, 8] * 6 + BASE, list(range(400, 440))]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def pair(tmp_path_factory, default_gguf):
    """(target, draft) directories: a tiny random Llama with its own output layer (so greedy
    tokens vary), and a copy whose every weight has noise added (about 1 in 8 greedy drafts
    accepted)."""
    out = tmp_path_factory.mktemp("draft-pair")
    target = build_tiny_llama(out / "target", default_gguf, seed=5, tie_word_embeddings=False)
    draft = out / "draft"
    shutil.copytree(target, draft)
    from safetensors.torch import load_file, save_file

    weights = load_file(target / "model.safetensors")
    gen = torch.Generator().manual_seed(9)
    noisy = {k: v + 0.5 * v.std() * torch.randn(v.shape, generator=gen) for k, v in weights.items()}
    save_file(noisy, draft / "model.safetensors", metadata={"format": "pt"})
    return target, draft


def _run(target, draft=None, temperature=0.0, params=None, lora=None, **overrides):
    """Every prompt through one engine (params[i] for prompt i where given); (harness,
    drafted, accepted) of the draft method."""
    spec = {"speculative": "off"}
    if draft is not None:
        spec = dict(speculative="draft", draft_model=resolve_model(str(draft)),
                    num_speculative_tokens=3)  # fmt: skip
    cfg = make_config(target, max_num_seqs=4, max_num_batched_tokens=64, **spec, **overrides)
    registry = CollectorRegistry()
    h = Harness(cfg, metrics=CoreMetrics(registry=registry))
    for i, prompt in enumerate(PROMPTS):
        seed = 100 + i if temperature else None
        p = SamplingParams(max_tokens=MAX_TOKENS, temperature=temperature, seed=seed)
        h.add(str(i), prompt, (params or {}).get(i, p), lora=lora or "")
    h.run()
    counts = [
        registry.get_sample_value(f"gapless_spec_{name}_tokens_total", {"method": "draft"}) or 0
        for name in ("draft", "accepted")
    ]
    return h, *counts


@pytest.fixture(scope="module")
def off(pair):
    return _run(pair[0])[0]


def test_a_draft_model_of_other_weights_gives_the_tokens_of_off(pair, off):
    h, drafted, accepted = _run(*pair)
    assert h.outputs == off.outputs
    assert 0 < accepted < drafted  # both an accepted and a rejected draft were verified
    assert (h.scheduler.rb.spec_extra == 0).all()


def test_the_model_drafting_for_itself_is_always_accepted(pair, off):
    h, drafted, accepted = _run(pair[0], pair[0])
    assert h.outputs == off.outputs
    assert drafted > 0 and accepted == drafted
    assert h.steps < off.steps * 0.6


def test_sampled_rows_keep_the_rules(pair):
    """Seeded, temperature 0.8: drafts of the other model accepted and rejected; on row 0,
    drafts that mostly fall outside allowed_token_ids (rejected, then drawn from the
    residual): every token allowed, the stop id ends the output, max_tokens holds."""
    allowed, stop = (1000, 2000, 3000), 3000
    rules = SamplingParams(max_tokens=12, temperature=0.8, seed=7, stop_token_ids=(stop,),
                           allowed_token_ids=allowed)  # fmt: skip
    h, drafted, accepted = _run(*pair, temperature=0.8, params={0: rules})
    assert 0 < accepted < drafted
    ids = h.outputs["0"]
    assert 0 < len(ids) <= 12 and set(ids) <= set(allowed) and stop not in ids[:-1]
    assert h.finish["0"] == ("stop_token" if ids[-1] == stop else "length")
    assert h.finish["0"] == "stop_token" or len(ids) == 12
    assert len(h.outputs["1"]) == len(h.outputs["2"]) == MAX_TOKENS


def test_a_lora_row_drafts_with_the_base_draft_and_keeps_its_adapter(pair, tmp_path):
    """The draft model runs no adapter; the verify does, so the tokens are the adapter's."""
    pytest.importorskip("peft")
    import transformers

    from tests.lora_adapters import make_adapter

    base = transformers.LlamaForCausalLM.from_pretrained(pair[0])
    make_adapter(base, "llama", tmp_path / "a", "plain", 0)
    lora = {"lora_modules": {"a": str(tmp_path / "a")}}
    plain = _run(pair[0], lora="a", **lora)[0]
    h, drafted, _ = _run(*pair, lora="a", **lora)
    assert drafted > 0 and h.outputs == plain.outputs


def test_a_constrained_row_does_not_draft(pair):
    import llguidance

    grammar = llguidance.LLMatcher.grammar_from_json_schema({"type": "object"})
    cfg = make_config(pair[0], speculative="draft", draft_model=resolve_model(str(pair[1])))
    h = Harness(cfg)
    h.add("json", PROMPTS[0], SamplingParams(max_tokens=4, grammar=grammar))
    h.add("free", PROMPTS[0], SamplingParams(max_tokens=4))
    draft = {rid: r.draft_method for rid, r in h.scheduler.requests.items()}
    assert draft == {"json": "", "free": "draft"}


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
