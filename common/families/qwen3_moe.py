"""Qwen3-MoE: Qwen3's attention (q and k head norms) over routed experts, no shared one."""

from __future__ import annotations

from gapless.common.families import qwen2_moe, qwen3
from gapless.common.families.base import Family, GGUFMeta, check_act, every_layer_slides


def options(config: dict) -> dict:
    check_act(config)
    bias = bool(config.get("attention_bias"))
    slides = every_layer_slides(config) if config.get("use_sliding_window") else {}
    return {"qk_norm": True, "attention_bias": bias, "o_bias": bias,
            **qwen2_moe.experts(config), **slides}  # fmt: skip


def gguf_options(meta: GGUFMeta) -> dict:
    return {"qk_norm": True, "norm_topk_prob": True}  # llama.cpp renormalizes Qwen3-MoE's top k


QWEN3_MOE = Family(
    name="qwen3_moe",
    model_types=("qwen3_moe",),
    options=options,
    gguf_arch="qwen3moe",
    moe=True,
    gguf_options=gguf_options,
    gguf_names=qwen3.QK_NORMS,
)
