"""Gemma's and the mixtures of experts' shapes on the cuda device against the cpu device
(fp32): sliding windows and soft caps through flashinfer's planned wrappers (prompts longer
than the window), experts through the grouped GEMM, decode steps through CUDA graphs."""

from __future__ import annotations

import pytest
import torch

from gapless.core.common.messages import SamplingParams
from gapless.gpu_runner.runner import ModelRunner
from tests.engine_harness import Harness, make_config
from tests.family_models import WINDOW, build
from tests.gpu_runner.test_cuda import BS, PROMPTS, _cuda, _step, gpu
from tests.gpu_runner.test_padding import Plans

pytest.importorskip("transformers")

# flashinfer's head sizes (64); widths the grouped GEMM takes (multiples of 8)
WIDE = dict(hidden_size=256, head_dim=64, intermediate_size=256)
SHAPES = {
    "gemma2": dict(WIDE, query_pre_attn_scalar=64),
    "gemma3": dict(WIDE, query_pre_attn_scalar=64),
    "mixtral": dict(WIDE, sliding_window=WINDOW),
    "qwen3_moe": dict(WIDE, moe_intermediate_size=128),
}
assert max(len(p) for p in PROMPTS.values()) > WINDOW


@pytest.fixture(scope="module", params=list(SHAPES))
def family_dir(request, tmp_path_factory, tiny_model_dir):
    out = tmp_path_factory.mktemp(f"cuda-{request.param}")
    build(request.param, out, tiny_model_dir, **SHAPES[request.param])
    return out


@pytest.mark.gpu
@gpu
def test_bf16_logits_and_greedy_match_cpu_fp32(family_dir):
    cpu = ModelRunner(make_config(family_dir, block_size=BS, max_num_seqs=8))
    cuda = _cuda(family_dir)
    assert cuda.use_graphs
    cpu_plans, cuda_plans = Plans(BS), Plans(BS)
    want, want_ids = _step(cpu, cpu_plans.step(PROMPTS, []))
    got, got_ids = _step(cuda, cuda_plans.step(PROMPTS, []))
    scale = want.std().item()
    for _ in range(8):  # decodes (graph replays) fed the cpu's tokens: no near tie derails them
        torch.testing.assert_close(got, want, atol=0.05 * scale, rtol=0.03)
        top2 = want.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 0.1 * scale
        pairs = zip(got_ids, want_ids, clear.tolist(), strict=True)
        assert all(g == w for g, w, c in pairs if c), "greedy differs where the winner is clear"
        carry = dict(zip(PROMPTS, want_ids, strict=True))
        want, want_ids = _step(cpu, cpu_plans.step({}, list(carry), carry))
        got, got_ids = _step(cuda, cuda_plans.step({}, list(carry), carry))


@pytest.mark.gpu
@gpu
def test_engine_on_cuda_runs_every_family_shape(family_dir):
    """Chunked prefill beside graph-replayed decodes to the end, every request finished."""
    config = make_config(family_dir, block_size=BS, max_num_seqs=8, max_num_batched_tokens=32)
    h = Harness(config, backend=_cuda(family_dir))
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    got = h.run({2 * i: [(f"r{i}", p, params)] for i, p in PROMPTS.items()})
    assert all(len(got[f"r{i}"]) == 24 for i in PROMPTS)
    assert h.scheduler.blocks.num_free == h.scheduler.blocks.num_usable
