"""Prompt logprobs (completions' echo + logprobs) and the sampler's logit rules through the whole
engine (EngineCore + cpu runner + detokenizer), against transformers on the same weights."""

from __future__ import annotations

import pytest
import torch

from gapless.common.messages import SamplingParams
from tests.engine_harness import Harness, make_config

transformers = pytest.importorskip("transformers")

PROMPT_LENS = [9, 40, 1, 23]
TOP = 3


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    model = transformers.LlamaForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32)
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 40000, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    want = []
    for p in prompts:
        with torch.no_grad():
            logits = model(torch.tensor([p])).logits[0].float()  # [n, V]
        lp = torch.log_softmax(logits, -1)
        targets = torch.tensor(p[1:])
        chosen = lp[:-1].gather(1, targets[:, None]).squeeze(1)  # [n - 1]
        top = lp[:-1].topk(TOP, dim=-1)
        want.append((chosen, top.indices, top.values))
    return prompts, want


@pytest.mark.parametrize(
    "limits",
    [
        dict(),
        dict(max_num_batched_tokens=16),  # chunked: a prompt's scores come in pieces
        dict(max_num_batched_tokens=32, kv_cache_memory=12 * 4096, block_size=4),  # preemption
    ],
    ids=["roomy", "chunked", "preempting"],
)
def test_prompt_logprobs_equal_transformers(tiny_model_dir, reference, limits):
    prompts, want = reference
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, prompt_logprobs=TOP)
    h = Harness(make_config(tiny_model_dir, **limits))
    h.run({i: [(f"r{i}", p, params)] for i, p in enumerate(prompts)})
    for i, p in enumerate(prompts):
        scored = [d.prompt_logprobs for d in h.deltas[f"r{i}"] if d.prompt_logprobs is not None]
        assert len(scored) == 1, f"request {i}: sent once"
        (items,) = scored
        if len(p) == 1:
            assert items == []
            continue
        chosen, top_ids, top_vals = want[i]
        assert [t.token_id for t in items] == p[1:]
        assert torch.allclose(torch.tensor([t.logprob for t in items]), chosen, atol=1e-3)
        assert [[x.token_id for x in t.top] for t in items] == top_ids.tolist()
        got_top = torch.tensor([[x.logprob for x in t.top] for t in items])
        assert torch.allclose(got_top, top_vals, atol=1e-3)
    if "kv_cache_memory" in limits:
        assert h.scheduler.num_preemptions > 0


def test_logit_bias_makes_greedy_pick_the_token(tiny_model_dir):
    h = Harness(make_config(tiny_model_dir))
    biased = SamplingParams(max_tokens=4, temperature=0.0, logit_bias=((1234, 100.0),))
    h.run({0: [("b", [5, 6, 7], biased), ("plain", [5, 6, 7], SamplingParams(4, 0.0))]})
    assert h.outputs["b"] == [1234] * 4
    assert h.outputs["plain"] != [1234] * 4


def test_min_tokens_holds_off_eos(tiny_model_dir):
    config = make_config(tiny_model_dir)
    eos = config.model.eos_token_ids[0]
    forced = ((eos, 100.0),)  # EOS would win every step
    h = Harness(config)
    h.run(
        {
            0: [
                ("min", [5, 6, 7], SamplingParams(8, 0.0, logit_bias=forced, min_tokens=3)),
                ("free", [5, 6, 7], SamplingParams(8, 0.0, logit_bias=forced)),
            ]
        }
    )
    assert h.outputs["free"] == [eos] and h.finish["free"] == "stop_token"
    assert len(h.outputs["min"]) == 4 and h.outputs["min"][-1] == eos
    assert eos not in h.outputs["min"][:3]
