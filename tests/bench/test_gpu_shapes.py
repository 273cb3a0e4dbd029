"""The GPU check's models of real shapes: their config.json, and the random-weight directory the
writer makes, which gapless's own loader and runner take (each family shrunk to run here)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors import safe_open

from gapless.bench.gpu_check import shapes
from gapless.bench.gpu_check.shapes import SHAPES, Shape, param_shape, write_model
from gapless.common.model_files import load_arch, load_tokenizer, resolve_model
from gapless.gpu_runner.cpu.backend import CpuBackend
from tests.engine_harness import make_config
from tests.gpu_runner.test_padding import Plans

TOKENIZER_VOCAB = 49152  # the default model's


def test_the_llama_shapes_are_the_issues():
    a = SHAPES["llama3-8b"].arch()
    assert (a.num_layers, a.hidden_size, a.num_heads, a.num_kv_heads, a.head_dim) == (
        32, 4096, 32, 8, 128
    )  # fmt: skip
    assert (a.vocab_size, a.intermediate_size, a.tie_word_embeddings) == (128256, 14336, False)
    b = SHAPES["llama3.2-1b"].arch()
    assert (b.num_layers, b.hidden_size, b.num_heads, b.num_kv_heads, b.head_dim) == (
        16, 2048, 32, 8, 64
    )  # fmt: skip
    assert (b.vocab_size, b.intermediate_size, b.tie_word_embeddings) == (128256, 8192, True)
    assert b.rope_scaling["rope_type"] == "llama3"


def test_cut_shapes_keep_their_width_and_say_why():
    for shape in SHAPES.values():
        arch = shape.arch()
        full = json.loads(json.dumps(shape.config))
        assert arch.hidden_size == full["hidden_size"] and arch.vocab_size == full["vocab_size"]
        if shape.layers is None:
            assert arch.num_layers == full["num_hidden_layers"]
        else:
            assert arch.num_layers == shape.layers < full["num_hidden_layers"]
            assert shape.why_layers
    gemma2 = SHAPES["gemma2-2b"].arch()
    assert gemma2.attn_softcap == 50.0 and gemma2.sliding_layers[:2] == (0, 2)
    assert SHAPES["qwen3-30b-a3b"].arch().num_experts == 128


# each family shrunk: the same options on widths that run in a moment
SMALL = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, vocab_size=TOKENIZER_VOCAB + 48, max_position_embeddings=512)  # fmt: skip
SMALL_MOE = dict(num_experts=4, num_local_experts=4, num_experts_per_tok=2,
                 moe_intermediate_size=32, shared_expert_intermediate_size=48)  # fmt: skip


def small(shape: Shape) -> Shape:
    config = {**shape.config, **SMALL}
    if "num_key_value_heads" in shape.config and shape.config["num_key_value_heads"] == 1:
        config["num_key_value_heads"] = 1
    if shape.family == "phi3":
        config.pop("head_dim")  # Phi-3 takes hidden / heads
    if shape.family == "qwen2":
        config.pop("head_dim")
    for key in SMALL_MOE:
        if key in shape.config:
            config[key] = SMALL_MOE[key]
    if config.get("sliding_window"):
        config["sliding_window"] = 8  # shorter than the prompts, so the windows matter
    return dataclasses.replace(shape, config=config, layers=3 if shape.layers is None else 2)


@pytest.mark.parametrize("name", list(SHAPES))
def test_a_written_model_loads_and_serves(name, tmp_path, default_gguf):
    shape = small(SHAPES[name])
    out = write_model(shape, tmp_path / name, default_gguf)
    info = resolve_model(str(out))
    arch = load_arch(info)
    assert arch == shape.arch() and arch.architecture == SHAPES[name].family
    assert load_tokenizer(info).get_vocab_size(True) == TOKENIZER_VOCAB
    assert info.eos_token_ids == (2,) and info.chat_template
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        for key in f.keys():
            t = f.get_tensor(key)
            assert t.dtype == torch.bfloat16 and tuple(t.shape) == param_shape(key, arch)
            if key in ("model.embed_tokens.weight", "lm_head.weight"):
                assert not t[TOKENIZER_VOCAB:].any() and t[:TOKENIZER_VOCAB].std() > 0.01
    runner = CpuBackend(make_config(out, block_size=16, max_num_seqs=4)).executor
    plans = Plans(16)
    prompts = {0: list(range(3, 40)), 1: [11, 12, 13]}
    ids = runner.execute(plans.step(prompts, [])).token_ids
    ids += runner.execute(plans.step({}, list(prompts))).token_ids
    assert all(0 <= i < TOKENIZER_VOCAB for i in ids)  # ids past the tokenizer are never picked


def test_the_safetensors_writer_streams_what_it_is_given(tmp_path):
    made = {"a": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3), "b": torch.ones(5)}
    tensors = [("a", (2, 3)), ("b", (5,))]
    size = shapes.write_safetensors(
        tmp_path / "m.safetensors", tensors, lambda n, s: made[n].to(torch.bfloat16)
    )
    assert size == (tmp_path / "m.safetensors").stat().st_size
    with safe_open(str(tmp_path / "m.safetensors"), framework="pt") as f:
        assert torch.equal(f.get_tensor("a"), made["a"])
        assert torch.equal(f.get_tensor("b"), made["b"].to(torch.bfloat16))
    with pytest.raises(AssertionError, match="is not"):
        shapes.write_safetensors(tmp_path / "bad.safetensors", [("a", (3, 2))],
                                 lambda n, s: made["a"])  # fmt: skip
