"""Every family against transformers on the same tiny random weights (float32): the whole
engine's greedy tokens equal `generate`'s for 64 tokens over several prompts (one longer than
the sliding windows), batched, chunked, preempted, with overlap on and off and a prefix-cache
hit; each token's logprob within 1e-3 of transformers'."""

from __future__ import annotations

import pytest
import torch

from gapless.common.messages import SamplingParams
from tests.engine_harness import Recorder, make_config
from tests.family_models import FAMILIES, WINDOW, build

transformers = pytest.importorskip("transformers")

PROMPT_LENS = [7, 45, 30]  # 45 > WINDOW: a wrong sliding mask shows; all below Phi-3's 64
NEW_TOKENS = 64
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0)
BLOCK = 4  # the preempting run's blocks
assert max(PROMPT_LENS) > WINDOW


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory, tiny_model_dir):
    """(name, model directory, prompts, transformers' greedy tokens and their logprobs)."""
    name = request.param
    out = tmp_path_factory.mktemp(name)
    ref = build(name, out, tiny_model_dir)
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 40000, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    tokens, logprobs = [], []
    for p in prompts:
        with torch.no_grad():
            out_ = ref.generate(
                torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False,
                eos_token_id=None, pad_token_id=0, output_logits=True,
                return_dict_in_generate=True,
            )  # fmt: skip
        new = out_.sequences[0, len(p) :].tolist()
        steps = torch.cat(out_.logits).float().log_softmax(-1)  # [NEW_TOKENS, vocab]
        tokens.append(new)
        logprobs.append(steps[torch.arange(len(new)), new].tolist())
    return name, out, prompts, tokens, logprobs


def _kv_bytes(model_dir, blocks: int) -> int:
    from gapless.common.model_files import load_arch, resolve_model

    arch = load_arch(resolve_model(str(model_dir)))
    return blocks * 2 * arch.num_layers * BLOCK * arch.num_kv_heads * arch.head_dim * 4


@pytest.mark.parametrize(
    "run", ["overlap", "chunked-preempted-no-overlap"]
)  # fmt: skip
def test_greedy_and_logprobs_equal_transformers(family, run):
    name, model_dir, prompts, want, want_lp = family
    if run == "overlap":
        config = make_config(model_dir, overlap=True)
    else:  # 40 blocks of 4 tokens: two of these requests at most
        config = make_config(model_dir, overlap=False, max_num_batched_tokens=16,
                             block_size=BLOCK, kv_cache_memory=_kv_bytes(model_dir, 40))  # fmt: skip
    h = Recorder(config)
    arrivals: dict = {}
    for i, p in enumerate(prompts):  # staggered arrivals: join while others decode
        arrivals.setdefault(2 * i, []).append((f"r{i}", p, GREEDY))
    # the long prompt again once its blocks are cached: a prefix-cache hit. A window over every
    # layer gives the small cache back what falls behind it (core/window.py): no preemption,
    # and the prompt's first blocks, given back first, are the first evicted, so it comes sooner
    # (tests/core/test_window_blocks.py preempts such a model)
    windowed = run != "overlap" and config.model.kv_window > 0
    arrivals.setdefault(10 if windowed else 40, []).append(("again", prompts[1], GREEDY))
    got = h.run(arrivals)
    for rid, i in [("r0", 0), ("r1", 1), ("r2", 2), ("again", 1)]:
        assert got[rid] == want[i], f"{name} {rid}: prompt of {len(prompts[i])} tokens"
        lp = torch.tensor(h.logprobs[rid])
        torch.testing.assert_close(lp, torch.tensor(want_lp[i]), atol=1e-3, rtol=0)
    assert h.cached["again"] > 0, "the repeated prompt found its prefix in the cache"
    if run != "overlap" and not windowed:
        assert h.scheduler.num_preemptions > 0, "the small cache was meant to force preemption"
    assert h.scheduler.blocks.num_free == h.scheduler.blocks.num_usable


def _run(config, prompts) -> Recorder:
    h = Recorder(config)
    h.run({2 * i: [(f"r{i}", p, GREEDY)] for i, p in enumerate(prompts)})
    return h


@pytest.mark.parametrize("kernel", [True, False], ids=["paged-kernel", "torch-attention"])
@pytest.mark.parametrize("family", ["mistral", "gemma3"], indirect=True)
def test_sliding_windows_on_each_cpu_attention_path(family, kernel):
    """Prompts longer than the window decode through the paged kernel and through torch's
    gather + SDPA, each with the window's mask."""
    from gapless.gpu_runner.cpu import kernels

    if kernel and not kernels.available(torch.float32):
        pytest.skip("no C++ compiler for the paged kernel")
    name, model_dir, prompts, want, _ = family
    h = _run(make_config(model_dir, attention_kernel=kernel), prompts)
    assert h.backend.attn.kernel == kernel
    assert any(layer.self_attn.window == WINDOW for layer in h.backend.model.model.layers)
    for i in range(len(prompts)):
        assert h.outputs[f"r{i}"] == want[i], f"{name} r{i}: prompt of {len(prompts[i])} tokens"


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gemma2", "mixtral"], indirect=True)
def test_the_compiled_decode_step_equals_transformers(family):
    """The compiled step with a family's options: Gemma 2's alternating windows and soft caps
    (layers of the first layer's kind replay its graph, the others run eagerly), Mixtral's
    experts (one operator in the graph)."""
    name, model_dir, prompts, want, _ = family
    h = _run(make_config(model_dir, compile=True), prompts)
    layers = h.backend.graphs.forward.keywords["run_layers"]
    assert h.backend.compiled and layers.num_graphs > 0
    assert layers.num_replayed > 0, "layers of the first one's kind replay its graph"
    for i in range(len(prompts)):
        assert h.outputs[f"r{i}"] == want[i], f"{name} r{i}: prompt of {len(prompts[i])} tokens"


@pytest.mark.parametrize("mode", ["int8", "w8a8", "int4"])
@pytest.mark.parametrize("family", list(FAMILIES), indirect=True)
def test_quantized_families_stay_near_float32(family, mode):
    """Every family takes the cpu's quantized layers (a mixture of experts keeps its routed
    experts in --dtype): a step's logits stay close to the float32 model's."""
    from gapless.common.model_files import load_arch, resolve_model
    from gapless.gpu_runner.cpu.formats import has_fbgemm
    from gapless.gpu_runner.cpu.quant import QUANTIZED, quantize_model
    from gapless.gpu_runner.model import CausalLM
    from gapless.gpu_runner.model.weights import load_weights

    if mode == "w8a8" and not has_fbgemm():
        pytest.skip("no fbgemm")
    name, model_dir, prompts, _, _ = family
    info = resolve_model(str(model_dir))
    arch = load_arch(info)
    models = []
    for quantization in ("none", mode):
        model = CausalLM(arch)
        model.load(load_weights(info, arch, torch.float32))
        quantize_model(model, quantization, info.path, arch)
        models.append(model.eval())
    swapped = [n for n, m in models[1].named_modules() if n.rsplit(".", 1)[-1] in QUANTIZED
               and not isinstance(m, torch.nn.Linear)]  # fmt: skip
    assert len(swapped) >= 2 * arch.num_layers
    ids = torch.tensor(prompts[1])
    dense, quant = (_logits(m, arch, ids) for m in models)
    cos = torch.nn.functional.cosine_similarity(dense, quant, dim=-1)
    assert cos.min() > (0.99 if mode == "int4" else 0.999), f"{name} {mode}: {cos.min()}"


def _logits(model, arch, ids: torch.Tensor, ctx=None) -> torch.Tensor:
    import numpy as np

    from gapless.gpu_runner.attention import StepLayout
    from gapless.gpu_runner.cpu.attention import TorchAttention

    n, bs = len(ids), 16
    pages = np.arange(1, -(-n // bs) + 1)[None, :]
    layout = StepLayout(np.array([n]), np.array([n]), pages, bs)
    meta = TorchAttention(4, 512, bs, arch.scale, False).build(layout, torch.arange(n) + bs)
    kv = [tuple(torch.zeros((pages.size + 1) * bs, arch.num_kv_heads, arch.head_dim)
                for _ in range(2)) for _ in range(arch.num_layers)]  # fmt: skip
    with torch.no_grad():
        return model(ids, torch.arange(n), kv, meta, torch.arange(n), ctx=ctx)
