"""The cuda device against the cpu device (fp32) and transformers: bf16 logits, greedy tokens,
graph replay against eager, and no host sync inside a decode step's launch."""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch

from gapless.common.messages import SamplingParams
from gapless.gpu_runner.cpu.backend import CpuBackend
from tests.conftest import build_tiny_llama
from tests.engine_harness import Harness, make_config
from tests.gpu_runner.test_padding import Plans, forward_plan

transformers = pytest.importorskip("transformers")
HAS_FLASHINFER = importlib.util.find_spec("flashinfer") is not None
gpu = pytest.mark.skipif(
    not (torch.cuda.is_available() and HAS_FLASHINFER), reason="needs CUDA and flashinfer"
)

BS = 16
# SmolLM2-135M's attention geometry (head_dim 64, 9 query heads on 3 KV heads), two thin layers:
# the kernels flashinfer builds here are the ones the default model runs
SMOL_HEADS = dict(hidden_size=576, num_attention_heads=9, num_key_value_heads=3)
PROMPTS = {0: list(range(3, 40)), 1: [11, 12, 13], 2: list(range(100, 120))}


@pytest.fixture(scope="module")
def cuda_model_dir(tmp_path_factory, default_gguf):
    return build_tiny_llama(tmp_path_factory.mktemp("smol-heads"), default_gguf, **SMOL_HEADS)


def _cuda(model_dir, **overrides):
    from gapless.gpu_runner.cuda.backend import CudaBackend

    config = make_config(
        model_dir, device="cuda", dtype="bfloat16", block_size=BS, max_num_seqs=8, **overrides
    )
    return CudaBackend(config)


def _step(runner, plan) -> tuple[torch.Tensor, list[int]]:
    """The step's logits [B_s, vocab] on the host, and its sampled ids."""
    with torch.inference_mode():
        inp, logits = forward_plan(runner, plan)
        host = logits.float().cpu()
        return host, runner.executor.sample(inp, logits).token_ids.tolist()


@pytest.mark.gpu
@gpu
def test_bf16_logits_and_greedy_match_cpu_fp32(cuda_model_dir):
    cpu = CpuBackend(make_config(cuda_model_dir, block_size=BS, max_num_seqs=8))
    cuda = _cuda(cuda_model_dir)
    cpu_plans, cuda_plans = Plans(BS), Plans(BS)
    want, want_ids = _step(cpu, cpu_plans.step(PROMPTS, []))
    got, got_ids = _step(cuda, cuda_plans.step(PROMPTS, []))
    # why tolerances scale with the logits' spread: each logit is a 576-term bf16 dot product,
    # whose rounding grows with the logit's size (~2 % of a spread of ~20 at the far tail)
    scale = want.std().item()
    for _ in range(5):  # decodes fed the cpu's tokens, so a near tie cannot derail the rest
        torch.testing.assert_close(got, want, atol=0.04 * scale, rtol=0.03)
        top2 = want.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 0.1 * scale
        pairs = zip(got_ids, want_ids, clear.tolist(), strict=True)
        assert all(g == w for g, w, c in pairs if c), "greedy differs where the winner is clear"
        carry = dict(zip(PROMPTS, want_ids, strict=True))
        want, want_ids = _step(cpu, cpu_plans.step({}, list(carry), carry))
        got, got_ids = _step(cuda, cuda_plans.step({}, list(carry), carry))


@pytest.mark.gpu
@gpu
def test_graph_replay_equals_eager(cuda_model_dir):
    cuda = _cuda(cuda_model_dir)
    plans = Plans(BS)
    _step(cuda, plans.step(PROMPTS, []))
    step = cuda.executor
    with torch.inference_mode():
        step.begin(plan := plans.step({}, list(PROMPTS)))
        inp, meta = step.prepare(plan)
        assert inp.padded and inp.num_rows == 4
        cuda.batch.upload(inp)
        replayed = cuda.graphs.run(inp.num_rows, meta).clone()
        eager = step.forward(inp.num_rows, meta)
    torch.testing.assert_close(replayed, eager, atol=1e-3, rtol=1e-3)


@pytest.mark.gpu
@gpu
def test_graphs_and_eager_give_the_same_tokens(cuda_model_dir):
    tokens = []
    for graphs in (True, False):
        cuda = _cuda(cuda_model_dir, cuda_graph=graphs)
        plans = Plans(BS)
        ids = [_step(cuda, plans.step(PROMPTS, []))[1]]
        ids += [_step(cuda, plans.step({}, list(PROMPTS)))[1] for _ in range(6)]
        tokens.append(ids)
    assert tokens[0] == tokens[1]


@pytest.mark.gpu
@gpu
def test_decode_launch_has_no_host_sync(cuda_model_dir):
    cuda = _cuda(cuda_model_dir)
    plans = Plans(BS)
    cuda.collect(cuda.launch(plans.step(PROMPTS, [])))
    for _ in range(2):
        cuda.collect(cuda.launch(plans.step({}, list(PROMPTS))))
    torch.cuda.set_sync_debug_mode("error")
    try:
        first = cuda.launch(plans.step({}, list(PROMPTS)))
        second = cuda.launch(plans.step({}, list(PROMPTS)))  # launched before first is read
    finally:
        torch.cuda.set_sync_debug_mode(0)
    for handle in (first, second):
        result = cuda.collect(handle)
        assert len(result.token_ids) == 3
        t = result.timing
        assert t.device_start <= t.device_end <= t.published + 1e-3
        assert cuda.seconds_until_ready(handle) == 0.0


@pytest.mark.gpu
@gpu
def test_engine_greedy_on_cuda_equals_transformers(cuda_model_dir):
    ref = transformers.LlamaForCausalLM.from_pretrained(cuda_model_dir, torch_dtype=torch.float32)
    prompts = [list(range(5, 5 + n)) for n in (5, 37, 12)]
    want = []
    for p in prompts:
        with torch.no_grad():
            out = ref.generate(
                torch.tensor([p]),
                max_new_tokens=4,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        want.append(out[0, len(p) :].tolist())
    config = make_config(cuda_model_dir, block_size=BS, max_num_seqs=8)
    h = Harness(config, backend=_cuda(cuda_model_dir))
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    got = h.run({0: [(f"r{i}", p, params) for i, p in enumerate(prompts)]})
    assert [got[f"r{i}"] for i in range(len(prompts))] == want


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("graphs", [True, False])
def test_ready_means_every_kernel_built_and_the_cache_sized(
    cuda_model_dir, graphs, caplog, monkeypatch
):
    from flashinfer.jit.core import JitSpec

    from gapless.gpu_runner.kv_cache import kv_block_bytes

    caplog.set_level("INFO", logger="gapless.gpu_runner")
    cuda = _cuda(cuda_model_dir, cuda_graph=graphs, max_num_batched_tokens=256)
    stages = [r.getMessage() for r in caplog.records if "cuda startup:" in r.getMessage()]
    names = ["weights loaded", "kernels built", "largest step run", "KV cache sized"]
    names += ["CUDA graphs captured"] if graphs else []
    assert [m.split(": ", 1)[1].split(" in ")[0] for m in stages] == names
    info = cuda.ready_info
    per_block = kv_block_bytes(cuda.arch, BS, cuda.dtype)
    assert info["kv_cache_bytes"] == cuda.num_blocks * per_block
    free, total = torch.cuda.mem_get_info()
    assert info["memory_total_bytes"] == total
    assert info["memory_budget_bytes"] == int(total * 0.9)
    assert torch.cuda.memory_allocated() <= info["memory_budget_bytes"]

    # what requests meet next compiles nothing: a prompt step, decodes, a mixed step
    def refuse(*args, **kwargs):
        raise AssertionError("a kernel was compiled after the runner said ready")

    monkeypatch.setattr(JitSpec, "build_and_load", refuse)
    plans = Plans(BS)
    _step(cuda, plans.step(PROMPTS, []))
    for _ in range(3):
        _step(cuda, plans.step({}, list(PROMPTS)))
    _step(cuda, plans.step({3: list(range(7, 207))}, list(PROMPTS)))


@pytest.mark.gpu
@gpu
def test_kv_cache_memory_overrides_the_sizing(cuda_model_dir):
    from gapless.gpu_runner.kv_cache import kv_block_bytes

    per_block = kv_block_bytes(_arch(cuda_model_dir), BS, torch.bfloat16)
    cuda = _cuda(cuda_model_dir, kv_cache_memory=40 * per_block)
    assert cuda.num_blocks == 40
    assert "memory_budget_bytes" not in cuda.ready_info
    assert cuda.ready_info["kv_cache_bytes"] == 40 * per_block
    # the warm-up left nothing a request could see (block 0 is the padding's scratch)
    assert all(not c[BS:].any() for kv in cuda.executor.kv_cache for c in kv)


def _arch(model_dir):
    from gapless.common.model_files import load_arch, resolve_model

    return load_arch(resolve_model(str(model_dir)))


def test_missing_flashinfer_is_a_clear_error(tiny_model_dir, monkeypatch):
    from gapless.gpu_runner.cuda.backend import CudaBackend

    monkeypatch.setitem(sys.modules, "flashinfer", None)  # import raises ImportError
    with pytest.raises(RuntimeError, match=r"pip install 'gapless\[cuda\]'"):
        CudaBackend(make_config(tiny_model_dir, device="cuda"))
