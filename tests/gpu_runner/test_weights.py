from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from gapless.common.model_files import load_arch, resolve_model
from gapless.gpu_runner.model.weights import load_weights, parameter_names

transformers = pytest.importorskip("transformers")


def _tiny_dir(path: Path, tie: bool, vocab_size: int = 96) -> dict[str, torch.Tensor]:
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=vocab_size,
        tie_word_embeddings=tie,
    )
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer = {
        "version": "1.0",
        "model": {"type": "WordLevel", "vocab": {"a": 0}, "unk_token": "a"},
    }
    (path / "tokenizer.json").write_text(json.dumps(tokenizer))
    return model.state_dict()


@pytest.mark.parametrize("tie", [False, True])
def test_hf_dir_weights_equal_state_dict(tmp_path: Path, tie: bool) -> None:
    state = _tiny_dir(tmp_path, tie)
    info = resolve_model(str(tmp_path))
    arch = load_arch(info)
    assert arch.tie_word_embeddings is tie
    weights = load_weights(info, arch, torch.float32)
    expected = set(state) - ({"lm_head.weight"} if tie else set())
    assert set(weights) == expected == set(parameter_names(arch))
    for name, tensor in weights.items():
        assert tensor.dtype == torch.float32
        torch.testing.assert_close(tensor, state[name], rtol=0, atol=0)
    assert load_weights(info, arch, torch.bfloat16)["model.norm.weight"].dtype == torch.bfloat16


def test_hf_dir_missing_lm_head(tmp_path: Path) -> None:
    _tiny_dir(tmp_path, tie=True)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}))
    info = resolve_model(str(tmp_path))
    with pytest.raises(ValueError, match="lm_head"):
        load_weights(info, load_arch(info), torch.float32)


def test_gguf_weights_equal_transformers(default_gguf: Path) -> None:
    info = resolve_model(str(default_gguf))
    arch = load_arch(info)
    weights = load_weights(info, arch, torch.float32)
    model = transformers.LlamaForCausalLM.from_pretrained(
        str(default_gguf.parent), gguf_file=default_gguf.name, torch_dtype=torch.float32
    )
    state = model.state_dict()
    assert set(weights) == set(state) - {"lm_head.weight"}  # tied
    for name, tensor in weights.items():
        assert tensor.shape == state[name].shape, name
        torch.testing.assert_close(tensor, state[name], rtol=0, atol=1e-6, msg=name)


def test_the_loader_holds_the_headers_to_the_arch_before_reading_data(tmp_path: Path) -> None:
    """The runner's own loader refuses a file that does not fit the architecture it was given,
    naming the tensor, before anything is read or built (common/model_check.py)."""
    import msgspec

    from tests.hostile_models import cut, write_gguf, write_hf

    info = resolve_model(str(write_hf(tmp_path / "hf")))
    arch = msgspec.structs.replace(load_arch(info), num_heads=10**6)  # a runner given 10^6 heads
    with pytest.raises(ValueError, match=r"model.safetensors: tensor .*q_proj.* \[64, 64\]"):
        load_weights(info, arch, torch.float32)
    path = write_gguf(tmp_path / "m.gguf")
    arch = load_arch(resolve_model(str(path)))
    cut(path, -100)
    with pytest.raises(ValueError, match="m.gguf: tensor 'blk.1.ffn_down.weight' .*past the end"):
        load_weights(resolve_model(str(path)), arch, torch.float32)
