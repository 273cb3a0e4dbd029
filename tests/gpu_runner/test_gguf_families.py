"""Families other than Llama from GGUF files written here by the `gguf` package, under
llama.cpp's names and conventions (its tensor name map, Gemma's norms stored as 1 + w, each
layer's experts stacked): the model's logits and the engine's greedy tokens equal
transformers' on the weights the file was written from."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from gapless.common.model_files import load_arch, read_gguf, resolve_model
from gapless.gpu_runner.attention import StepLayout
from gapless.gpu_runner.cpu.attention import TorchAttention
from gapless.gpu_runner.model import CausalLM
from gapless.gpu_runner.model.weights import load_weights
from tests.engine_harness import Harness, make_config
from tests.family_models import build

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

ARCHS = {"qwen3": "QWEN3", "gemma2": "GEMMA2", "qwen3_moe": "QWEN3MOE"}
# GGUF keeps no query_pre_attn_scalar: llama.cpp scales Gemma 2's scores by 1 / sqrt(head_dim);
# and its Gemma 2 has no output layer of its own (tied to the embeddings)
OVERRIDES = {"gemma2": dict(query_pre_attn_scalar=16, tie_word_embeddings=True)}
TOKENIZER_KEYS = ("model", "pre", "tokens", "token_type", "merges", "bos_token_id",
                  "eos_token_id")  # fmt: skip


def _tensors(family: str, state: dict[str, torch.Tensor], layers: int, tied: bool) -> dict:
    """Hugging Face tensors under llama.cpp's names, as its converter writes them."""
    names = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, ARCHS[family]), layers)
    state = dict(state)
    for i in range(layers):  # each layer's experts stacked into one tensor per projection
        for proj in ("gate_proj", "up_proj", "down_proj"):
            part = f"model.layers.{i}.mlp.experts.{{}}.{proj}.weight"
            stack = [state.pop(part.format(j)) for j in range(8) if part.format(j) in state]
            if stack:
                state[f"model.layers.{i}.mlp.experts.{proj}.weight"] = torch.stack(stack)
    out = {}
    for name, t in state.items():
        if name == "lm_head.weight" and tied:
            continue  # llama.cpp writes tied embeddings once
        if family.startswith("gemma") and name.endswith("norm.weight"):
            t = t + 1  # llama.cpp stores Gemma's (1 + w)
        new = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert new is not None, name
        out[new] = t.float().numpy()
    return out


def write_gguf(path: Path, family: str, ref, default_gguf: Path) -> Path:
    """`family`'s GGUF beside its Hugging Face directory (path's folder), from the checkpoint."""
    from safetensors.torch import load_file

    cfg = ref.config
    w = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[getattr(gguf.MODEL_ARCH, ARCHS[family])])
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if family == "gemma2":
        w.add_sliding_window(cfg.sliding_window)
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    if family == "qwen3_moe":
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    meta = read_gguf(default_gguf).metadata  # SmolLM2's tokenizer
    for key in TOKENIZER_KEYS:
        w.add_key_value(f"tokenizer.ggml.{key}", *_typed(meta[f"tokenizer.ggml.{key}"]))
    state = load_file(path.parent / "model.safetensors")  # the checkpoint's own names
    for name, array in _tensors(
        family, state, cfg.num_hidden_layers, cfg.tie_word_embeddings
    ).items():
        w.add_tensor(name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _typed(value):
    if isinstance(value, str):
        return value, gguf.GGUFValueType.STRING
    if isinstance(value, list):
        return value, gguf.GGUFValueType.ARRAY
    if isinstance(value, np.ndarray):
        return value.tolist(), gguf.GGUFValueType.ARRAY
    return int(value), gguf.GGUFValueType.UINT32


@pytest.fixture(scope="module", params=list(ARCHS))
def written(request, tmp_path_factory, tiny_model_dir, default_gguf):
    family = request.param
    out = tmp_path_factory.mktemp(f"gguf-{family}")
    ref = build(family, out, tiny_model_dir, **OVERRIDES.get(family, {}))
    return family, write_gguf(out / f"{family}.gguf", family, ref, default_gguf), ref


def test_a_written_gguf_gives_transformers_logits(written):
    family, path, ref = written
    info = resolve_model(str(path))
    arch = load_arch(info)
    assert info.architecture == arch.architecture == family
    model = CausalLM(arch)
    model.load(load_weights(info, arch, torch.float32))
    n, bs = 40, 16
    ids = torch.randint(3, 40000, (n,), generator=torch.Generator().manual_seed(3))
    layout = StepLayout(np.array([n]), np.array([n]), np.arange(1, 4)[None, :], bs)
    meta = TorchAttention(4, 512, bs, arch.scale, False).build(layout, torch.arange(n) + bs)
    kv = [tuple(torch.zeros(5 * bs, arch.num_kv_heads, arch.head_dim) for _ in range(2))
          for _ in range(arch.num_layers)]  # fmt: skip
    with torch.no_grad():
        got = model(ids, torch.arange(n), kv, meta, torch.arange(n))
        want = ref(ids[None]).logits[0]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_a_written_gguf_serves_transformers_greedy_tokens(written):
    from gapless.common.messages import SamplingParams

    family, path, ref = written
    prompt = torch.randint(3, 40000, (30,), generator=torch.Generator().manual_seed(5)).tolist()
    with torch.no_grad():
        want = ref.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False,
                            eos_token_id=None, pad_token_id=0)[0, 30:].tolist()  # fmt: skip
    h = Harness(make_config(path))
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    assert h.run({0: [("r", prompt, params)]})["r"] == want
