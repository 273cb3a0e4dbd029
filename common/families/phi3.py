"""Phi-3 / Phi-4 (mini): checkpoints hold q, k, v as one qkv_proj and gate, up as one
gate_up_proj; LongRoPE; a partial rotary share (Phi-4-mini); a window over every layer where
config.json sets one."""

from __future__ import annotations

from gapless.common.families.base import Family, GGUFMeta, check_act, every_layer_slides


def options(config: dict) -> dict:
    check_act(config)
    return every_layer_slides(config)


def gguf_options(meta: GGUFMeta) -> dict:
    """LongRoPE's factors are tensors in llama.cpp's files."""
    if "rope_factors_long.weight" not in meta.tensors:
        return {}
    return {
        "rope_scaling": {
            "rope_type": "longrope",
            "short_factor": meta.read_f32("rope_factors_short.weight").tolist(),
            "long_factor": meta.read_f32("rope_factors_long.weight").tolist(),
            "original_max_position_embeddings": int(
                meta.key("rope.scaling.original_context_length")
            ),
            "attention_factor": float(meta.key("rope.scaling.attn_factor", 1.0)),
        }
    }


PHI3 = Family(
    name="phi3",
    model_types=("phi3",),
    options=options,
    fused=True,
    gguf_arch="phi3",
    gguf_options=gguf_options,
    # llama.cpp keeps Phi-3's joined rows: ffn_up holds gate's rows, then up's
    gguf_names={
        "attn_qkv.weight": "self_attn.qkv_proj.weight",
        "ffn_up.weight": "mlp.gate_up_proj.weight",
    },  # fmt: skip
)
