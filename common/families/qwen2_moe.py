"""Qwen2-MoE (Qwen1.5-MoE): Qwen2's attention; routed experts (top-k, renormalized where
norm_topk_prob) beside a shared expert gated by a sigmoid; dense MLPs on mlp_only_layers and
off the decoder_sparse_step."""

from __future__ import annotations

from gapless.common.families import qwen2
from gapless.common.families.base import Family, GGUFMeta, check_act

SHARED = {"ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
          "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
          "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
          "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight"}  # fmt: skip


def experts(config: dict) -> dict:
    """The routed experts and the layers left dense, as Qwen's MoE configs say."""
    n, step = int(config["num_hidden_layers"]), int(config.get("decoder_sparse_step") or 1)
    only = set(config.get("mlp_only_layers") or [])
    return dict(
        num_experts=int(config.get("num_experts") or config["num_local_experts"]),
        num_experts_per_tok=int(config["num_experts_per_tok"]),
        moe_intermediate_size=int(config["moe_intermediate_size"]),
        norm_topk_prob=bool(config.get("norm_topk_prob", False)),
        dense_layers=tuple(i for i in range(n) if i in only or (i + 1) % step),
    )


def options(config: dict) -> dict:
    check_act(config)
    rule = lambda i, c: (i + 1) % 2 and i < c.get("max_window_layers", 28)  # noqa: E731
    return {
        "attention_bias": bool(config.get("qkv_bias", True)),
        "shared_expert_intermediate_size": int(config.get("shared_expert_intermediate_size") or 0),
        **experts(config),
        **qwen2.windows(config, rule),
    }


def gguf_options(meta: GGUFMeta) -> dict:
    return {
        "shared_expert_intermediate_size": int(meta.key("expert_shared_feed_forward_length", 0)),
        "norm_topk_prob": False,
    }


QWEN2_MOE = Family(
    name="qwen2_moe",
    model_types=("qwen2_moe",),
    options=options,
    gguf_arch="qwen2moe",
    moe=True,
    gguf_options=gguf_options,
    gguf_names=SHARED,
)
