"""Gemma 2: embeddings scaled by sqrt(hidden), GeGLU, RMSNorm by (1 + w) before and after both
attention and MLP, soft-capped attention scores and logits, sliding and global layers in turn,
scores scaled by query_pre_attn_scalar."""

from __future__ import annotations

import numpy as np

from gapless.common.families.base import BadField, Family, GGUFMeta, check_act, real, sliding

GELU = ("gelu_pytorch_tanh", "gelu")
# llama.cpp's names for the norms after attention and MLP; its ffn_norm is the one before
SANDWICH = {"post_attention_norm.weight": "post_attention_layernorm.weight",
            "ffn_norm.weight": "pre_feedforward_layernorm.weight",
            "post_ffw_norm.weight": "post_feedforward_layernorm.weight"}  # fmt: skip
DEFAULTS = dict(hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6, query_pre_attn_scalar=256,
                sliding_window=4096, final_logit_softcapping=30.0, attn_logit_softcapping=50.0,
                tie_word_embeddings=True, head_dim=256, max_position_embeddings=8192)  # fmt: skip


def shared(config: dict) -> dict:
    """The options Gemma 2 and 3 share."""
    if config.get("use_bidirectional_attention"):
        raise NotImplementedError("bidirectional attention (an embedding model) is not supported")
    key = "hidden_activation" if config.get("hidden_activation") else "hidden_act"
    scalar = real(config["query_pre_attn_scalar"], "attn_scale")
    if not scalar > 0:  # why here: its inverse square root is the scale
        raise BadField("attn_scale", f"{scalar} must be positive")
    return dict(
        norm_offset=1.0,
        sandwich_norm=True,
        hidden_act=check_act(config, key, GELU),
        embed_scale=float(config["hidden_size"]) ** 0.5,
        attn_scale=scalar**-0.5,
        final_softcap=float(config.get("final_logit_softcapping") or 0.0),
        attention_bias=bool(config.get("attention_bias")),
        o_bias=bool(config.get("attention_bias")),
    )


def options(config: dict) -> dict:
    n = int(config["num_hidden_layers"])
    kinds = config.get("layer_types") or [
        "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)
    ]
    return {
        **shared(config),
        "attn_softcap": float(config.get("attn_logit_softcapping") or 0.0),
        **sliding(config, kinds),
    }


def gguf_shared(meta: GGUFMeta, pattern: int, big_layers: int) -> dict:
    """Gemma's options from GGUF: the file's norms hold 1 + w already; a query scale of
    1 / sqrt(hidden / heads) for the 27B shapes, as llama.cpp takes it, else 1 / sqrt(head_dim)."""
    hidden, heads = int(meta.key("embedding_length")), int(meta.key("attention.head_count"))
    n = int(meta.key("block_count"))
    head_dim = int(meta.key("attention.key_length", hidden // heads))
    window = int(meta.key("attention.sliding_window", 0))
    # newer llama.cpp files name the pattern: a period, or each layer's flag
    pattern = meta.metadata.get(f"{meta.arch}.attention.sliding_window_pattern", pattern)
    if isinstance(pattern, int | np.integer):
        slides = [bool((i + 1) % int(pattern)) for i in range(n)]
    else:
        slides = [bool(flag) for flag in pattern]
    return dict(
        sandwich_norm=True,
        hidden_act="gelu_pytorch_tanh",
        embed_scale=float(hidden) ** 0.5,
        attn_scale=(hidden / heads if n == big_layers else head_dim) ** -0.5,
        final_softcap=float(meta.key("final_logit_softcapping", 0.0)),
        sliding_window=window,
        sliding_layers=tuple(i for i in range(n) if slides[i]) if window else (),
    )


def gguf_options(meta: GGUFMeta) -> dict:
    return {
        **gguf_shared(meta, 2, 46),
        "attn_softcap": float(meta.key("attn_logit_softcapping", 0.0)),
    }


GEMMA2 = Family(
    name="gemma2",
    model_types=("gemma2",),
    options=options,
    defaults=DEFAULTS,
    gguf_arch="gemma2",
    gguf_options=gguf_options,
    gguf_names=SANDWICH,
)
