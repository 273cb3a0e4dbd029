"""Greedy outputs of the engine (the in-process EngineCore + the cpu runner) equal
transformers' per-prompt greedy, whatever the batching, chunking, preemption and overlap."""

from __future__ import annotations

import pytest
import torch

from gapless.common.messages import SamplingParams
from tests.engine_harness import Harness, make_config

transformers = pytest.importorskip("transformers")

PROMPT_LENS = [5, 37, 12, 70, 1, 23]
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    model = transformers.LlamaForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32)
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 40000, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    want = []
    for p in prompts:
        with torch.no_grad():
            out = model.generate(
                torch.tensor([p]),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        want.append(out[0, len(p) :].tolist())
    return prompts, want


GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize(
    "depth, deep_plan_ms", [(1, 0.0), (2, 0.0), (3, 1e9)], ids=["no-overlap", "overlap", "deep"]
)
@pytest.mark.parametrize(
    "limits",
    [
        dict(),  # roomy: everything batched together
        dict(max_num_batched_tokens=16),  # chunked prefill mixed with decodes
        dict(max_num_batched_tokens=32, kv_cache_memory=12 * 4096, block_size=4),  # preemption
    ],
    ids=["roomy", "chunked", "preempting"],
)
def test_greedy_equals_transformers(tiny_model_dir, reference, depth, deep_plan_ms, limits):
    prompts, want = reference
    config = make_config(tiny_model_dir, overlap=depth > 1, deep_plan_ms=deep_plan_ms, **limits)
    h = Harness(config)
    arrivals: dict = {}
    for i, p in enumerate(prompts):  # staggered arrivals: join while others decode
        arrivals.setdefault(2 * i, []).append((f"r{i}", p, GREEDY))
    got = h.run(arrivals)
    for i in range(len(prompts)):
        assert got[f"r{i}"] == want[i], f"request {i} (prompt {len(prompts[i])} tokens)"
        assert h.finish[f"r{i}"] == "length"
    if "kv_cache_memory" in limits:
        assert h.scheduler.num_preemptions > 0, "the small cache was meant to force preemption"
    assert h.scheduler.blocks.num_free == h.scheduler.blocks.num_usable
    assert h.max_inflight == depth
