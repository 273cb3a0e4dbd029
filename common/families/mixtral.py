"""Mixtral: Mistral's layers with a mixture of experts for the MLP (top-k of the router's
softmax, renormalized)."""

from __future__ import annotations

from gapless.common.families import mistral
from gapless.common.families.base import Family, GGUFMeta


def options(config: dict) -> dict:
    return {
        **mistral.options(config),
        "num_experts": int(config["num_local_experts"]),
        "num_experts_per_tok": int(config["num_experts_per_tok"]),
        "moe_intermediate_size": int(config["intermediate_size"]),
        "norm_topk_prob": True,
    }


def gguf_options(meta: GGUFMeta) -> dict:
    return {"moe_intermediate_size": int(meta.key("feed_forward_length")), "norm_topk_prob": True}


MIXTRAL = Family(
    name="mixtral",
    model_types=("mixtral",),
    options=options,
    renames=(
        (".block_sparse_moe.", ".mlp."),
        (".w1.", ".gate_proj."),
        (".w3.", ".up_proj."),
        (".w2.", ".down_proj."),
    ),  # fmt: skip
    # llama.cpp writes Mixtral as llama with experts
    gguf_arch="llama",
    moe=True,
    gguf_options=gguf_options,
    gguf_permuted_qk=True,
)
