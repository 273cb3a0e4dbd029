"""Gemma 3 (text): Gemma 2's layers without attention soft-capping, with RMSNorm (1 + w) over
each head of q and k, five sliding layers to a global one, and a RoPE base of their own for the
sliding layers. Reads the multimodal checkpoints' language model too."""

from __future__ import annotations

from gapless.common.families import gemma2
from gapless.common.families.base import Family, GGUFMeta, rope_params, rope_scaling, sliding
from gapless.common.families.qwen3 import QK_NORMS

DEFAULTS = {**gemma2.DEFAULTS, "final_logit_softcapping": None, "attn_logit_softcapping": None,
            "max_position_embeddings": 131072, "sliding_window_pattern": 6,
            "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0}  # fmt: skip


def options(config: dict) -> dict:
    n = int(config["num_hidden_layers"])
    pattern = int(
        config.get("sliding_window_pattern") or config.get("_sliding_window_pattern") or 6
    )
    kinds = config.get("layer_types") or [
        "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)
    ]
    full = rope_params(config, "full_attention")
    local = (config.get("rope_parameters") or {}).get("sliding_attention") or {}
    if rope_scaling(local, config) is not None:
        raise NotImplementedError("RoPE scaling on Gemma 3's sliding layers is not supported")
    return {
        **gemma2.shared(config),
        # why: transformers' Gemma 3 reads attn_logit_softcapping but never applies it
        "attn_softcap": 0.0,
        "qk_norm": True,
        "rope_theta": float(full.get("rope_theta", config["rope_theta"])),
        "rope_scaling": rope_scaling(full, config),
        "local_rope_theta": float(local.get("rope_theta", config["rope_local_base_freq"])),
        **sliding(config, kinds),
    }


def gguf_options(meta: GGUFMeta) -> dict:
    # llama.cpp's Gemma 3: a sliding layer in six, their RoPE base fixed at 10000
    return {**gemma2.gguf_shared(meta, 6, 62), "qk_norm": True, "local_rope_theta": 10_000.0}


GEMMA3 = Family(
    name="gemma3",
    model_types=("gemma3_text", "gemma3"),
    options=options,
    defaults=DEFAULTS,
    text_config="text_config",
    # the multimodal checkpoints' language model, as transformers 4 and 5 save it
    renames=(
        ("model.language_model.", "model."),
        ("language_model.model.", "model."),
        ("language_model.lm_head.", "lm_head."),
    ),  # fmt: skip
    gguf_arch="gemma3",
    gguf_options=gguf_options,
    gguf_names={**gemma2.SANDWICH, **QK_NORMS},
)
