"""What makes a decoder's numbers impossible or its output NaN, found before anything is built:
counts that are not positive, heads that do not split, a RoPE or norm that divides by zero or
turns every logit into NaN, a top-k beyond the experts, factor lists of the wrong length.

A problem is a BadField naming ModelArch's field; families/__init__.py names the file and
turns the field into the key that file gives it (config.json's or the GGUF metadata's).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

from gapless.common.families.base import BadField, ModelArch, rope_attention_factor, whole

# config.json's key for each ModelArch field whose name differs from it
HF_KEYS = {"num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
           "num_kv_heads": "num_key_value_heads", "max_position": "max_position_embeddings",
           "local_rope_theta": "rope_local_base_freq", "attn_scale": "query_pre_attn_scalar",
           "attn_softcap": "attn_logit_softcapping", "rotary_dim": "partial_rotary_factor",
           "final_softcap": "final_logit_softcapping"}  # fmt: skip
# the GGUF metadata's, after "{general.architecture}."; tensors where the file keeps it there
GGUF_KEYS = {"hidden_size": "embedding_length", "intermediate_size": "feed_forward_length",
             "num_layers": "block_count", "num_heads": "attention.head_count",
             "num_kv_heads": "attention.head_count_kv", "head_dim": "attention.key_length",
             "rope_theta": "rope.freq_base", "rms_norm_eps": "attention.layer_norm_rms_epsilon",
             "max_position": "context_length", "sliding_window": "attention.sliding_window",
             "rotary_dim": "rope.dimension_count", "num_experts": "expert_count",
             "num_experts_per_tok": "expert_used_count",
             "moe_intermediate_size": "expert_feed_forward_length",
             "shared_expert_intermediate_size": "expert_shared_feed_forward_length",
             "attn_softcap": "attn_logit_softcapping",
             "final_softcap": "final_logit_softcapping",
             "rope_scaling": "rope.scaling.type", "rope_scaling.factor": "rope.scaling.factor",
             "rope_scaling.original_max_position_embeddings":
                 "rope.scaling.original_context_length",
             "rope_scaling.attention_factor": "rope.scaling.attn_factor"}  # fmt: skip
GGUF_TENSORS = {"rope_scaling.factors": "rope_freqs.weight",
                "rope_scaling.short_factor": "rope_factors_short.weight",
                "rope_scaling.long_factor": "rope_factors_long.weight"}  # fmt: skip


def hf_key(field: str, config: dict) -> str:
    """config.json's key for a ModelArch field (Mixtral's experts have keys of their own)."""
    if field == "num_experts" and "num_experts" not in config:
        return "num_local_experts"
    if field == "moe_intermediate_size" and "moe_intermediate_size" not in config:
        return "intermediate_size"
    return HF_KEYS.get(field, field)


def gguf_key(field: str, arch: str) -> str:
    if field in GGUF_TENSORS:
        return f"tensor {GGUF_TENSORS[field]}"
    if field == "vocab_size":
        return "tokenizer.ggml.tokens"
    return f"{arch}.{GGUF_KEYS.get(field, field)}"


def _positive(value: float, field: str) -> None:
    if not (math.isfinite(value) and value > 0):
        raise BadField(field, f"{value} must be positive and finite")


def _at_least_zero(value: float, field: str) -> None:
    if not (math.isfinite(value) and value >= 0):
        raise BadField(field, f"{value} must be finite and not negative")


def check_arch(a: ModelArch, moe: bool = False) -> None:
    """BadField for the first number of `a` that the decoder cannot take; moe: the family
    routes experts, so it needs some."""
    for field in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                  "head_dim", "max_position"):  # fmt: skip
        whole(getattr(a, field), field)
    if a.num_heads % a.num_kv_heads:
        raise BadField("num_kv_heads", f"{a.num_kv_heads} does not divide the {a.num_heads} heads")
    rot = a.rotary_dim or a.head_dim
    if rot % 2 or rot > a.head_dim:
        raise BadField("rotary_dim", f"{rot} dims rotate, not an even number up to {a.head_dim}")
    _positive(a.rope_theta, "rope_theta")
    _positive(a.rms_norm_eps, "rms_norm_eps")
    for field in ("local_rope_theta", "attn_scale", "attn_softcap", "final_softcap"):
        _at_least_zero(getattr(a, field), field)
    _positive(a.embed_scale, "embed_scale")
    if a.sliding_layers or a.sliding_window:
        whole(a.sliding_window, "sliding_window")
    _check_experts(a, moe)
    _check_rope(a, a.rope_scaling, rot // 2)


def _check_experts(a: ModelArch, moe: bool) -> None:
    if not moe and not a.num_experts:
        return
    whole(a.num_experts, "num_experts")
    if not 1 <= a.num_experts_per_tok <= a.num_experts:
        raise BadField(
            "num_experts_per_tok",
            f"{a.num_experts_per_tok} must be from 1 to the {a.num_experts} experts",
        )
    whole(a.moe_intermediate_size, "moe_intermediate_size")
    whole(a.shared_expert_intermediate_size, "shared_expert_intermediate_size", low=0)


def _check_rope(a: ModelArch, s: dict | None, half: int) -> None:
    """The scaling's numbers: present where its kind needs them, finite, positive; its factor
    lists one per rotated pair of dims (half of them)."""
    if s is None:
        return
    kind = s["rope_type"]
    for key, value in _numbers(s):
        if key in ("mscale", "mscale_all_dim"):  # 0: off, as transformers reads them
            _at_least_zero(value, f"rope_scaling.{key}")
        else:
            _positive(value, f"rope_scaling.{key}")
    for key in ("factors", "short_factor", "long_factor"):
        if key in s and len(s[key]) != half:
            raise BadField(
                f"rope_scaling.{key}",
                f"has {len(s[key])} factors for {half} rotated pairs (rope_type {kind})",
            )
    if kind == "llama3" and s["high_freq_factor"] <= s["low_freq_factor"]:
        raise BadField("rope_scaling.high_freq_factor", "must be above low_freq_factor")
    if kind == "yarn" and a.rope_theta == 1.0:  # why: YaRN's ramp divides by log(theta)
        raise BadField("rope_theta", "1.0 cannot take YaRN scaling")
    try:
        factor = rope_attention_factor(s, a.max_position)
    except (ValueError, ZeroDivisionError):
        factor = math.nan
    _positive(factor, "rope_scaling.attention_factor")


def _numbers(s: dict) -> Iterator[tuple[str, float]]:
    """Every number of a scaling (lists' items too), but the flags."""
    for key, value in s.items():
        if key in ("rope_type", "truncate"):
            continue
        for x in value if isinstance(value, list) else [value]:
            yield key, x
