"""peft's adapter files read and held to the base: what each config option means for the scale
and rank of each module, and every adapter gapless cannot serve as it is refused with an
AdapterError naming the option, file or module, before anything is kept."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from gapless.common.model_files import load_arch, resolve_model
from gapless.gpu_runner.lora.adapter import AdapterError, load_adapter, pattern_value

pytest.importorskip("peft")

Q = "model.layers.0.self_attn.q_proj"


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory, tiny_model_dir):
    """A peft adapter (r 8, alpha 16, rank/alpha patterns) on the tiny Llama."""
    import transformers
    from peft import LoraConfig, get_peft_model

    base = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    config = LoraConfig(r=8, lora_alpha=16, init_lora_weights=False, target_modules="all-linear",
                        rank_pattern={"v_proj": 4}, alpha_pattern={"layers.1.mlp.down_proj": 2})  # fmt: skip
    out = tmp_path_factory.mktemp("adapter")
    get_peft_model(base, config).save_pretrained(out, safe_serialization=True)
    return out


@pytest.fixture(scope="module")
def arch(tiny_model_dir):
    return load_arch(resolve_model(str(tiny_model_dir)))


def _copy(adapter_dir, tmp_path, **config):
    out = tmp_path / "copy"
    shutil.copytree(adapter_dir, out)
    path = out / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    return out


def _tensors(path, change) -> None:
    file = path / "adapter_model.safetensors"
    tensors = load_file(file)
    change(tensors)
    save_file(tensors, file)


def test_the_config_sets_each_modules_rank_and_scale(adapter_dir, arch):
    a = load_adapter("a", adapter_dir, arch)
    assert a.rank == 8 and len(a.modules) == 7 * arch.num_layers  # all-linear: every projection
    assert a.modules[Q].scale == 16 / 8 and a.modules[Q].a.shape == (8, arch.hidden_size)
    v = a.modules["model.layers.0.self_attn.v_proj"]
    assert v.a.shape[0] == 4 and v.scale == 16 / 4  # rank_pattern's r, the config's alpha
    assert a.modules["model.layers.1.mlp.down_proj"].scale == 2 / 8  # alpha_pattern's
    assert a.modules["model.layers.0.mlp.down_proj"].scale == 16 / 8
    assert a.modules[Q].a.dtype == torch.float32


def test_rslora_scales_by_the_root_of_the_rank(adapter_dir, arch, tmp_path):
    a = load_adapter("a", _copy(adapter_dir, tmp_path, use_rslora=True), arch)
    assert a.modules[Q].scale == pytest.approx(16 / math.sqrt(8))


def test_pattern_keys_match_as_peft_does():
    patterns = {"q_proj": 1, "layers.1.mlp.down_proj": 2}
    assert pattern_value(patterns, "model.layers.0.self_attn.q_proj", 0) == 1
    assert pattern_value(patterns, "model.layers.1.mlp.down_proj", 0) == 2
    assert pattern_value(patterns, "model.layers.11.mlp.down_proj", 0) == 0  # at a dot only
    assert pattern_value(patterns, "model.layers.0.self_attn.xq_proj", 0) == 0


@pytest.mark.parametrize(
    ("config", "words"),
    [
        ({"use_dora": True}, "use_dora"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"bias": "all"}, "bias"),
        ({"lora_bias": True}, "lora_bias"),
        ({"peft_type": "IA3"}, "peft_type"),
        ({"target_modules": ["q_proj", "embed_tokens"]}, "embeddings"),
        ({"rank_pattern": {"v_proj": 2}}, "do not fit"),
        ({"trainable_token_indices": [1, 2]}, "trainable_token_indices"),
    ],
)  # fmt: skip
def test_unsupported_options_are_refused(adapter_dir, arch, tmp_path, config, words):
    with pytest.raises(AdapterError, match=words):
        load_adapter("a", _copy(adapter_dir, tmp_path, **config), arch)


def test_a_rank_over_the_cap_is_refused(adapter_dir, arch):
    with pytest.raises(AdapterError, match="rank 8 is over --max-lora-rank 4"):
        load_adapter("a", adapter_dir, arch, max_rank=4)


def _rename(old: str, new: str):
    def change(tensors):
        for key in [k for k in tensors if old in k]:
            tensors[key.replace(old, new)] = tensors.pop(key)

    return change


@pytest.mark.parametrize(
    ("change", "words"),
    [
        (_rename("layers.0.self_attn.q_proj", "layers.0.self_attn.qkv_proj"), "not a projection"),
        (_rename("layers.1.", "layers.9."), "not a projection"),
        (_rename("layers.0.self_attn.q_proj", "lm_head"), "output layer"),
        (_rename("layers.0.mlp.up_proj", "layers.0.mlp.experts.0.up_proj"), "routed experts"),
        (_rename("q_proj.lora_A", "q_proj.lora_C"), "not a LoRA A or B"),
        (lambda t: t.update({f"base_model.model.{Q}.lora_B.weight": torch.zeros(65, 8)}),
         "do not fit"),
        (lambda t: t.pop(f"base_model.model.{Q}.lora_B.weight"), "both"),
    ],
)  # fmt: skip
def test_weights_that_do_not_fit_the_family_are_refused(adapter_dir, arch, tmp_path, change,
                                                        words):  # fmt: skip
    path = _copy(adapter_dir, tmp_path)
    _tensors(path, change)
    with pytest.raises(AdapterError, match=words):
        load_adapter("a", path, arch)


def test_only_safetensors_are_read(adapter_dir, arch, tmp_path):
    path = _copy(adapter_dir, tmp_path)
    (path / "adapter_model.safetensors").rename(path / "adapter_model.bin")
    with pytest.raises(AdapterError, match="only safetensors"):
        load_adapter("a", path, arch)
    with pytest.raises(AdapterError, match="not a directory"):
        load_adapter("a", tmp_path / "nowhere", arch)
    (path / "adapter_model.safetensors").write_bytes(b"")
    (path / "adapter_config.json").write_text("[1]")
    with pytest.raises(AdapterError, match="not a JSON object"):
        load_adapter("a", path, arch)


def test_phi3_takes_its_joined_projections_only(tmp_path, tiny_model_dir, adapter_dir):
    """Phi-3's checkpoints join q/k/v and gate/up: an adapter on its separate parts names
    layers it does not have."""
    from tests.family_models import build

    build("phi3", tmp_path / "phi3", tiny_model_dir)
    phi3 = load_arch(resolve_model(str(tmp_path / "phi3")))
    with pytest.raises(AdapterError, match="not a projection of this phi3 model"):
        load_adapter("a", adapter_dir, phi3)
    path = _copy(adapter_dir, tmp_path)
    qkv = phi3.num_heads * phi3.head_dim + 2 * phi3.num_kv_heads * phi3.head_dim
    key = "base_model.model.model.layers.0.self_attn.qkv_proj"
    save_file({f"{key}.lora_A.weight": torch.ones(8, phi3.hidden_size),
               f"{key}.lora_B.weight": torch.ones(qkv, 8)},
              path / "adapter_model.safetensors")  # fmt: skip
    a = load_adapter("a", path, phi3)
    assert list(a.modules) == ["model.layers.0.self_attn.qkv_proj"]
