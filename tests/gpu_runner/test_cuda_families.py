"""Gemma's and the mixtures of experts' shapes on the cuda device against the cpu device
(fp32): sliding windows and soft caps through flashinfer's planned wrappers (prompts longer
than the window), experts through the grouped GEMM, decode steps through CUDA graphs."""

from __future__ import annotations

import pytest
import torch

from gapless.common.messages import SamplingParams
from gapless.gpu_runner.cpu.backend import CpuBackend
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
    cpu = CpuBackend(make_config(family_dir, block_size=BS, max_num_seqs=8))
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


class _Wrapper:
    """Stands in for a flashinfer wrapper: records its plans and which one ran."""

    ran: list = []

    def __init__(self, *args, **kwargs) -> None:
        self.kwargs = kwargs
        self.plans: list[dict] = []

    def plan(self, *args, **kwargs) -> None:
        self.plans.append(kwargs)

    def run(self, q, kv):
        _Wrapper.ran.append(self)
        return q


class _Event:
    def record(self) -> None: ...

    def query(self) -> bool:
        return True


def test_flashinfer_plans_a_wrapper_per_window_with_the_cap_and_scale(monkeypatch, tmp_path,
                                                                      tiny_model_dir):  # fmt: skip
    """Without a GPU: the plan parameters flashinfer gets for Gemma 2 (a window on alternate
    layers, soft-capped scores, query_pre_attn_scalar), and which wrapper each layer runs."""
    import sys
    import types

    import numpy as np

    from gapless.common.model_files import load_arch, resolve_model
    from gapless.gpu_runner.attention import StepLayout
    from gapless.gpu_runner.cuda.flashinfer_attention import FlashinferAttention

    fake = types.SimpleNamespace(BatchPrefillWithPagedKVCacheWrapper=_Wrapper,
                                 BatchDecodeWithPagedKVCacheWrapper=_Wrapper)  # fmt: skip
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self)
    build("gemma2", tmp_path, tiny_model_dir, **SHAPES["gemma2"])
    arch = load_arch(resolve_model(str(tmp_path)))
    attn = FlashinferAttention(arch, BS, 8, torch.bfloat16, torch.device("cpu"))
    graph = attn.add_graph_size(2, torch.zeros(2, dtype=torch.long))
    assert set(graph.wrappers) == set(attn.decode) == set(attn.prefill) == {0, WINDOW}
    for layout in (
        StepLayout(np.array([40, 3]), np.array([40, 3]), np.array([[1, 2, 3], [4, 0, 0]]), BS),
        StepLayout(np.array([1, 1]), np.array([41, 4]), np.array([[1, 2, 3], [4, 0, 0]]), BS),
    ):
        meta = attn.build(layout, torch.zeros(2, dtype=torch.long))
        for window, wrapper in meta.wrappers.items():
            plan = wrapper.plans[-1]
            assert plan["window_left"] == (WINDOW - 1 if window else -1)
            assert plan["logits_soft_cap"] == 4.0 and plan["sm_scale"] == 64**-0.5
        assert (meta is graph) == layout.is_decode
        q = torch.zeros(2, 4, 64)
        kv = torch.zeros(8 * BS, 2, 64)
        _Wrapper.ran.clear()
        meta.attend(q, q[:, :2], q[:, :2], kv, kv.clone(), WINDOW, 4.0)
        meta.attend(q, q[:, :2], q[:, :2], kv, kv.clone())
        assert _Wrapper.ran == [meta.wrappers[WINDOW], meta.wrappers[0]]
