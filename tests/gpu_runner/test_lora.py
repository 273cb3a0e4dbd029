"""LoRA adapters against transformers + peft on the same tiny random weights (float32): for
each family, requests of four adapters (plain, rank_pattern/alpha_pattern, rsLoRA, all-linear)
and base requests run mixed in one engine; each one's 64 greedy tokens are peft's greedy
choices and each token's logprob is within 1e-3 of peft's; the mixed run equals each request
run alone."""

from __future__ import annotations

import pytest
import torch

from gapless.common.messages import SamplingParams
from tests.engine_harness import Recorder, make_config
from tests.family_models import build
from tests.lora_adapters import KINDS, make_adapter, scores

pytest.importorskip("peft")

NEW_TOKENS = 64
PROMPT_LENS = [9, 23]
# why fewer for Phi-3: past its original context (64 in the tiny model) transformers' LongRoPE
# turns every position of the sequence to the long factors, so the one-pass reference (scores)
# holds only for sequences within it (tests/gpu_runner/test_families.py checks the switch)
NEW = {"phi3": 64 - max(PROMPT_LENS)}


def _greedy(name: str) -> SamplingParams:
    n = NEW.get(name, NEW_TOKENS)
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module", params=["llama", "qwen3", "gemma2", "phi3"])
def family(request, tmp_path_factory, tiny_model_dir):
    """(name, model dir, {adapter: dir}, prompts, {adapter: transformers' model}); adapter ""
    is the base."""
    name = request.param
    out = tmp_path_factory.mktemp(name)
    base = build(name, out / "model", tiny_model_dir)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 40000, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    dirs, refs = {}, {"": base}
    for seed, kind in enumerate(KINDS):
        dirs[kind] = out / kind
        refs[kind] = make_adapter(base, name, dirs[kind], kind, seed)
    return name, out / "model", dirs, prompts, refs


def _requests(refs, prompts) -> list[tuple[str, str, list[int]]]:
    """(request id, adapter, prompt) of every adapter (and the base) on every prompt."""
    return [(f"{a or 'base'}/{i}", a, p) for a in refs for i, p in enumerate(prompts)]


def _run(model_dir, dirs, requests, params, apart: int = 1) -> Recorder:
    """The requests through one engine, the k-th joining before step k * apart."""
    lora = {k: str(v) for k, v in dirs.items()}
    h = Recorder(make_config(model_dir, lora_modules=lora, max_loras=len(lora)))
    h.run({k * apart: [(rid, p, params, "", 0, None, a)] for k, (rid, a, p) in
           enumerate(requests)})  # fmt: skip
    return h


def test_mixed_adapters_equal_peft(family):
    """Base and adapter requests of every kind, joining one a step (prefills beside decodes)."""
    name, model_dir, dirs, prompts, refs = family
    requests = _requests(refs, prompts)
    params = _greedy(name)
    h = _run(model_dir, dirs, requests, params)
    for rid, adapter, prompt in requests:
        got = h.outputs[rid]
        assert len(got) == params.max_tokens
        chosen, lps = scores(refs[adapter], prompt, got)
        assert got == chosen, f"{name} {rid}: first differs at {_first_diff(got, chosen)}"
        torch.testing.assert_close(torch.tensor(h.logprobs[rid]), torch.tensor(lps),
                                   atol=1e-3, rtol=0)  # fmt: skip
    base = h.outputs["base/0"]
    assert all(h.outputs[f"{a}/0"] != base for a in KINDS), "each adapter changes the tokens"


def _first_diff(a: list[int], b: list[int]) -> int:
    return next(i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y)


@pytest.mark.parametrize("family", ["llama"], indirect=True)
def test_a_mixed_batch_equals_each_request_alone(family):
    """Four adapters and the base in one batch give each request what it gets alone."""
    _, model_dir, dirs, prompts, refs = family
    requests = _requests(refs, prompts[:1])
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=0)
    mixed = _run(model_dir, dirs, requests, params)
    alone = _run(model_dir, dirs, requests, params, apart=params.max_tokens + 8)
    assert mixed.steps < alone.steps / 3, "the mixed run's steps hold several requests"
    for rid in alone.outputs:  # the alone run's: each request's steps after the last's
        first, last = alone.token_steps[rid][0], alone.token_steps[rid][-1]
        assert all(not set(range(first, last)) & set(alone.token_steps[o])
                   for o in alone.outputs if o != rid), rid  # fmt: skip
    for rid, _, _ in requests:
        assert mixed.outputs[rid] == alone.outputs[rid], rid
        torch.testing.assert_close(torch.tensor(mixed.logprobs[rid]),
                                   torch.tensor(alone.logprobs[rid]), atol=1e-5, rtol=0)  # fmt: skip


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("family", ["llama"], indirect=True)
def test_a_quantized_base_keeps_the_adapter_as_close_as_itself(family, mode, tmp_path):
    """(quantized base + adapter) is as near (float32 base + adapter) as the quantized base is
    to the float32 base, by the quantization tests' measure (the logits' cosine), averaged over
    the prompt's positions: the worst position alone moves several times over between prompts.
    The adapter is the plain one with B a tenth as large: the exactness adapters are outsized
    on purpose (B A several times the base's weights, so greedy tokens change), where the
    base's rounding errors then weigh several times more; a trained adapter moves the weights
    by a fraction of themselves."""
    import shutil

    from safetensors.torch import load_file, save_file

    from gapless.common.model_files import load_arch, resolve_model
    from gapless.gpu_runner.cpu.quant import quantize_model
    from gapless.gpu_runner.lora.adapter import load_adapter
    from gapless.gpu_runner.lora.stack import LoraStack
    from gapless.gpu_runner.model import CausalLM
    from gapless.gpu_runner.model.projection import StepContext
    from gapless.gpu_runner.model.weights import load_weights
    from tests.gpu_runner.test_families import _logits

    _, model_dir, dirs, prompts, _ = family
    info = resolve_model(str(model_dir))
    arch = load_arch(info)
    ids = torch.tensor(prompts[1])
    rows = torch.arange(len(ids))
    ctx = StepContext(rows * 0, rows * 0 + 1, span=(1, 1))  # every row: adapter 1
    small = tmp_path / "small"
    shutil.copytree(dirs["plain"], small)
    weights = load_file(small / "adapter_model.safetensors")
    save_file({k: v / 10 if ".lora_B." in k else v for k, v in weights.items()},
              small / "adapter_model.safetensors")  # fmt: skip
    logits = {}
    for quantization in ("none", mode):
        model = CausalLM(arch)
        model.load(load_weights(info, arch, torch.float32))
        quantize_model(model, quantization, info.path, arch)
        model.eval()
        logits[quantization, False] = _logits(model, arch, ids)
        LoraStack(model, arch, 1, 16, 4).add(load_adapter("a", small, arch))
        logits[quantization, True] = _logits(model, arch, ids, ctx)
    assert not torch.allclose(logits["none", False], logits["none", True], atol=0.01)

    def gap(adapter: bool) -> float:
        dense, quant = logits["none", adapter], logits[mode, adapter]
        return 1 - torch.nn.functional.cosine_similarity(dense, quant, dim=-1).mean().item()

    assert gap(True) <= max(2 * gap(False), 1e-6), (gap(True), gap(False))


@pytest.mark.parametrize("family", ["llama"], indirect=True)
def test_base_requests_pay_nothing_and_the_cache_keeps_adapters_apart(family):
    """With adapters loaded, base requests give exactly what a server without them gives (the
    same calls: no step of theirs has adapter rows); a prompt cached under one adapter (or the
    base) is a hit for that adapter only."""
    _, model_dir, dirs, prompts, _ = family
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0)
    plain = Recorder(make_config(model_dir))
    plain.run({0: [("b", prompts[1], params)]})
    h = Recorder(make_config(model_dir, lora_modules={k: str(v) for k, v in dirs.items()}))
    p = prompts[1]  # 23 tokens: one full 16-token block to cache
    h.run({0: [("b", p, params)]})
    assert h.outputs["b"] == plain.outputs["b"] and h.logprobs["b"] == plain.logprobs["b"]
    h.run({h.steps: [("plain", p, params, "", 0, None, "plain")]})
    h.run({h.steps: [("rslora", p, params, "", 0, None, "rslora")]})
    h.run({h.steps: [("plain-again", p, params, "", 0, None, "plain")]})
    h.run({h.steps: [("b-again", p, params)]})
    assert h.cached["plain"] == h.cached["rslora"] == 0
    assert h.cached["plain-again"] == h.cached["b-again"] == 16
    assert h.outputs["plain-again"] == h.outputs["plain"] != h.outputs["b"]


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama"], indirect=True)
def test_the_compiled_step_runs_base_steps_and_leaves_adapter_steps_eager(family):
    """With --compile, steps with adapter rows run eagerly and the others through the compiled
    layers; every request gets what the eager runner gives it."""
    _, model_dir, dirs, prompts, refs = family
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=0)
    requests = _requests({"": None, "plain": None, "rslora": None}, prompts[:1])
    requests.append(("late-base", "", prompts[1]))  # alone at the end: base-only steps
    runs = []
    for compile_ in (False, True):
        lora = {k: str(dirs[k]) for k in ("plain", "rslora")}
        h = Recorder(make_config(model_dir, compile=compile_, lora_modules=lora, max_loras=2))
        h.run({k if rid != "late-base" else 60: [(rid, p, params, "", 0, None, a)]
               for k, (rid, a, p) in enumerate(requests)})  # fmt: skip
        runs.append(h)
    eager, compiled = runs
    layers = compiled.backend.graphs.forward.keywords["run_layers"]
    assert compiled.backend.compiled and layers.num_graphs > 0 and layers.num_replayed > 0
    assert compiled.outputs == eager.outputs
    for rid in eager.outputs:
        torch.testing.assert_close(torch.tensor(compiled.logprobs[rid]),
                                   torch.tensor(eager.logprobs[rid]), atol=1e-4, rtol=0)  # fmt: skip
