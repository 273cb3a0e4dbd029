"""Tiny random models of every family gapless serves, built with transformers (no download)
and saved as Hugging Face directories with SmolLM2's tokenizer, for the tests that hold our
decoder to transformers' (tests/gpu_runner/test_families.py) and serve them."""

from __future__ import annotations

import json
from pathlib import Path

SHAPE = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, max_position_embeddings=512, tie_word_embeddings=False,
             bos_token_id=1, eos_token_id=2, pad_token_id=0)  # fmt: skip
WINDOW = 24  # a sliding window shorter than the long prompts
EXPERTS = dict(num_experts_per_tok=2)

# family -> (transformers config class, its arguments beyond SHAPE)
FAMILIES: dict[str, tuple[str, dict]] = {
    "llama": ("LlamaConfig", dict(num_hidden_layers=2)),
    "mistral": ("MistralConfig", dict(num_hidden_layers=2, sliding_window=WINDOW)),
    "qwen2": ("Qwen2Config", dict(num_hidden_layers=2)),
    "qwen3": ("Qwen3Config", dict(num_hidden_layers=2, attention_bias=True)),
    "gemma2": (
        "Gemma2Config",
        dict(
            num_hidden_layers=3,
            sliding_window=WINDOW,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=4.0,
            final_logit_softcapping=15.0,
        ),
    ),  # fmt: skip
    "gemma3": (
        "Gemma3TextConfig",
        dict(
            num_hidden_layers=3,
            sliding_window=WINDOW,
            query_pre_attn_scalar=24,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            },
            final_logit_softcapping=20.0,
        ),
    ),  # fmt: skip
    "phi3": (
        "Phi3Config",
        # LongRoPE with an original context of 64: generation crosses it; 3/4 of a head rotates
        dict(
            num_hidden_layers=2,
            original_max_position_embeddings=64,
            partial_rotary_factor=0.75,
            rope_scaling={
                "type": "longrope",
                "short_factor": [1.0 + 0.05 * i for i in range(6)],
                "long_factor": [1.5 + 0.25 * i for i in range(6)],
            },
        ),
    ),  # fmt: skip
    "mixtral": ("MixtralConfig", dict(num_hidden_layers=2, num_local_experts=8, **EXPERTS)),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        dict(
            num_hidden_layers=3,
            num_experts=8,
            moe_intermediate_size=48,
            shared_expert_intermediate_size=64,
            mlp_only_layers=[1],
            **EXPERTS,
        ),
    ),  # fmt: skip
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(
            num_hidden_layers=2,
            num_experts=8,
            moe_intermediate_size=48,
            norm_topk_prob=True,
            **EXPERTS,
        ),
    ),  # fmt: skip
}


def config_of(family: str, vocab_size: int, **overrides):
    import transformers

    cls, args = FAMILIES[family]
    kwargs = {**SHAPE, **args, "vocab_size": vocab_size, **overrides}
    if family in ("phi3",):
        kwargs.pop("head_dim")  # Phi-3 takes hidden_size / heads
    return getattr(transformers, cls)(**kwargs)


def build(family: str, out: Path, tokenizer_dir: Path, seed: int = 0, **overrides):
    """A random `family` model in `out` (safetensors, config.json, SmolLM2's tokenizer), and
    the transformers model itself (float32, eval)."""
    import torch
    import transformers

    vocab = json.loads((tokenizer_dir / "config.json").read_text())["vocab_size"]
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config_of(family, vocab, **overrides))
    with torch.no_grad():  # sharper logits than the default init, so greedy has clear winners
        model.get_input_embeddings().weight.normal_(0, 1.0)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") and family.startswith("gemma"):
                p.normal_(0, 0.1)  # Gemma's norms scale by 1 + w: w of zeros would hide a bug
    model.save_pretrained(out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (out / name).write_bytes((tokenizer_dir / name).read_bytes())
    return model.float().eval()
