"""Qwen3: RMSNorm over each head of q and k before RoPE; attention_bias on all four
projections when set."""

from __future__ import annotations

from gapless.common.families import qwen2
from gapless.common.families.base import Family, GGUFMeta, check_act

QK_NORMS = {"attn_q_norm.weight": "self_attn.q_norm.weight",
            "attn_k_norm.weight": "self_attn.k_norm.weight"}  # fmt: skip


def options(config: dict) -> dict:
    check_act(config)
    bias = bool(config.get("attention_bias"))
    return {"qk_norm": True, "attention_bias": bias, "o_bias": bias, **qwen2.windows(config)}


def gguf_options(meta: GGUFMeta) -> dict:
    return {"qk_norm": True}


QWEN3 = Family(
    name="qwen3",
    model_types=("qwen3",),
    options=options,
    gguf_arch="qwen3",
    gguf_options=gguf_options,
    gguf_names=QK_NORMS,
)
