"""What a decoder is made of (ModelArch: its shapes and options) and what a family declares
(Family: how its config.json and GGUF metadata give them). No torch here: the frontend and
the core read these too; the layers live in gpu_runner/model/."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np


class BadField(ValueError):
    """A value a decoder cannot take; `field` is ModelArch's name for it (dotted below
    rope_scaling: "rope_scaling.factor")."""

    def __init__(self, field: str, why: str) -> None:
        super().__init__(why)
        self.field, self.why = field, why


def whole(value: Any, name: str, low: int = 1) -> int:
    """value as an int of at least `low`; a float only when it is whole (JSON's 4.0)."""
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if ok and not isinstance(value, numbers.Integral):
        ok = math.isfinite(value) and float(value).is_integer()
    if not ok or int(value) < low:
        at_least = "0 or more" if low == 0 else f"at least {low}"
        raise BadField(name, f"{value!r} must be a whole number, {at_least}")
    return int(value)


def real(value: Any, name: str) -> float:
    """value as a float (NaN and infinities too: check_arch says which are allowed)."""
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise BadField(name, f"{value!r} is not a number")
    return float(value)


class ModelArch(msgspec.Struct, frozen=True, kw_only=True):
    """Shapes and options of one decoder; an option's default is Llama's."""

    architecture: str  # the family's name (common/families)
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections carry biases
    # None: plain RoPE; else {"rope_type": linear | dynamic | yarn | longrope | llama3 |
    # factors, and that kind's keys as transformers names them} (factors: GGUF's per-frequency
    # divisors, "factors", and for longrope "short_factor"/"long_factor")
    rope_scaling: dict | None = None
    rotary_dim: int = 0  # leading dims of each head that rotate; 0: all of them
    local_rope_theta: float = 0.0  # sliding layers' own plain-RoPE base; 0: the global RoPE
    o_bias: bool = False  # the attention's output projection carries a bias
    qk_norm: bool = False  # RMSNorm over each head of q and of k, before RoPE
    norm_offset: float = 0.0  # RMSNorm multiplies by (offset + weight): Gemma's 1 + w
    sandwich_norm: bool = False  # attention and MLP outputs normed before the residual add
    hidden_act: str = "silu"  # the MLP gate's activation, as transformers names it
    embed_scale: float = 1.0  # embeddings are multiplied by this
    attn_scale: float = 0.0  # softmax scale of q.k; 0: head_dim ** -0.5
    attn_softcap: float = 0.0  # attention scores s -> cap * tanh(s / cap); 0: none
    final_softcap: float = 0.0  # the same on the output logits
    sliding_window: int = 0  # keys a sliding layer's query sees, its own included; 0: none
    sliding_layers: tuple[int, ...] = ()  # the layers that slide
    # mixture of experts; 0 experts: every MLP is dense
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True  # the top-k routing weights renormalized to sum to 1
    shared_expert_intermediate_size: int = 0  # a gated dense expert beside the routed ones
    dense_layers: tuple[int, ...] = ()  # layers of a MoE model whose MLP is dense

    @property
    def scale(self) -> float:
        return self.attn_scale or self.head_dim**-0.5

    def window(self, layer: int) -> int:
        """Keys layer `layer` attends to, its own included; 0: all."""
        return self.sliding_window if layer in self.sliding_layers else 0

    @property
    def kv_window(self) -> int:
        """The window when every layer slides (the KV blocks behind it are never read again);
        0 when some layer attends to the whole context."""
        every = all(self.window(i) for i in range(self.num_layers))
        return self.sliding_window if every else 0

    def is_moe(self, layer: int) -> bool:
        return self.num_experts > 0 and layer not in self.dense_layers


@dataclass(frozen=True)
class GGUFMeta:
    """A GGUF file's metadata as a family reads it: keys under the file's architecture."""

    path: str
    arch: str  # general.architecture
    metadata: dict[str, Any]
    tensors: frozenset[str]
    read_f32: Callable[[str], np.ndarray]  # a small F32 tensor's values, by GGUF name

    def key(self, suffix: str, default: Any = None) -> Any:
        value = self.metadata.get(f"{self.arch}.{suffix}", default)
        if value is None:
            raise ValueError(f"{self.path}: metadata {self.arch}.{suffix} is missing")
        if isinstance(value, np.ndarray):
            raise NotImplementedError(
                f"{self.path}: per-layer {self.arch}.{suffix} is not supported"
            )
        return value


def _no_gguf(meta: GGUFMeta) -> dict:
    return {}


@dataclass(frozen=True)
class Family:
    """One family's declaration over the shared decoder: how its files give ModelArch's options.

    Its checkpoints use Hugging Face's Llama names (model.layers.N.self_attn.q_proj.weight, ...)
    after `renames`; a GGUF's tensors take the shared llama.cpp names (weights.py) and
    `gguf_names`."""

    name: str
    model_types: tuple[str, ...]  # config.json's model_type values it reads
    # config.json (defaults filled in) -> ModelArch's fields beyond the shared shapes
    options: Callable[[dict], dict] = lambda config: {}
    defaults: dict = field(default_factory=dict)  # config values a file may leave out
    text_config: str = ""  # a multimodal config's key that holds the decoder's own config
    renames: tuple[tuple[str, str], ...] = ()  # checkpoint name parts -> ours, in order
    fused: bool = False  # checkpoints hold qkv_proj and gate_up_proj joined (Phi-3)
    moe: bool = False  # routed experts (a GGUF of the same architecture without is another)
    gguf_arch: str = ""  # general.architecture as llama.cpp writes it; "": none read
    gguf_options: Callable[[GGUFMeta], dict] = _no_gguf  # GGUF metadata -> options
    gguf_names: dict[str, str] = field(default_factory=dict)  # after blk.N.: GGUF -> ours
    gguf_permuted_qk: bool = False  # llama.cpp interleaved each q and k head's rotary halves


# ---------------------------------------------------------------------------------------------
# what every family shares: shapes and RoPE from config.json


def rope_params(config: dict, layer_type: str = "") -> dict:
    """The RoPE keys of config.json, old style (rope_theta, rope_scaling) or new
    (rope_parameters, per layer type where it is split)."""
    params = config.get("rope_parameters") or {}
    if layer_type and isinstance(params.get(layer_type), dict):
        params = params[layer_type]
    scaling = config.get("rope_scaling") or {}
    return {**scaling, **params}


def rope_scaling(params: dict, config: dict) -> dict | None:
    """The RoPE scaling of transformers' keys, checked and normalized; None for plain RoPE."""
    kind = params.get("rope_type", params.get("type"))
    kind = {"su": "longrope", "mrope": "default"}.get(kind, kind)
    if kind in (None, "default"):
        return None
    if kind not in ("linear", "dynamic", "llama3", "yarn", "longrope"):
        raise NotImplementedError(
            f"rope scaling {kind!r} is not supported "
            "(supported: linear, dynamic, yarn, longrope, llama3)"
        )
    original = params.get("original_max_position_embeddings") or config.get(
        "original_max_position_embeddings"
    )
    params = {**params, "original_max_position_embeddings": original}

    def need(key: str) -> Any:
        if params.get(key) is None:
            raise BadField(f"rope_scaling.{key}", f"is missing; rope_type {kind} needs it")
        return params[key]

    def number(key: str) -> float:
        return real(need(key), f"rope_scaling.{key}")

    def count(key: str) -> int:
        return whole(need(key), f"rope_scaling.{key}")

    if kind in ("linear", "dynamic"):
        return {"rope_type": kind, "factor": number("factor")}
    if kind == "llama3":
        return {
            "rope_type": kind,
            "factor": number("factor"),
            "low_freq_factor": number("low_freq_factor"),
            "high_freq_factor": number("high_freq_factor"),
            "original_max_position_embeddings": count("original_max_position_embeddings"),
        }
    original = count("original_max_position_embeddings")
    if kind == "yarn":
        out = {"rope_type": kind, "original_max_position_embeddings": original}
        for key in ("factor", "attention_factor", "beta_fast", "beta_slow", "mscale",
                    "mscale_all_dim"):  # fmt: skip
            if params.get(key) is not None:
                out[key] = number(key)
        out["truncate"] = bool(params.get("truncate", True))
        return out
    out = {"rope_type": kind, "original_max_position_embeddings": original}
    for key in ("short_factor", "long_factor"):
        factors = need(key)
        if not isinstance(factors, list):
            raise BadField(f"rope_scaling.{key}", f"{factors!r} is not a list of numbers")
        out[key] = [real(x, f"rope_scaling.{key}") for x in factors]
    for key in ("factor", "attention_factor"):
        if params.get(key) is not None:
            out[key] = number(key)
    return out


def rope_attention_factor(scaling: dict | None, max_position: int) -> float:
    """What cos and sin are multiplied by under this scaling (YaRN's and LongRoPE's mscale)."""
    if scaling is None or scaling["rope_type"] not in ("yarn", "longrope"):
        return 1.0
    if scaling.get("attention_factor") is not None:
        return scaling["attention_factor"]
    original = scaling["original_max_position_embeddings"]
    if scaling["rope_type"] == "longrope":
        factor = scaling.get("factor") or max_position / original
        return 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    factor = scaling.get("factor") or max_position / original

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return mscale(factor, scaling["mscale"]) / mscale(factor, scaling["mscale_all_dim"])
    return mscale(factor)


def context_length(config: dict) -> int:
    """Positions the model takes: max_position_embeddings, or YaRN's stretched context."""
    context = whole(config.get("max_position_embeddings", 2048), "max_position")
    params = rope_params(config)
    if params.get("rope_type", params.get("type")) == "yarn" and params.get("factor"):
        original = params.get("original_max_position_embeddings")
        factor = real(params["factor"], "rope_scaling.factor")
        if original and math.isfinite(factor) and factor > 0:
            original = whole(original, "rope_scaling.original_max_position_embeddings")
            context = max(context, int(original * factor))
    return context


def shapes(config: dict) -> dict:
    """ModelArch's shared fields from a config.json (family defaults filled in)."""
    heads = whole(config.get("num_attention_heads"), "num_heads")
    hidden = whole(config.get("hidden_size"), "hidden_size")
    head_dim = head_size(config.get("head_dim"), hidden, heads)
    params = rope_params(config)
    theta = params.get("rope_theta", config.get("rope_theta"))
    partial = real(
        params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0)),
        "rotary_dim",
    )
    if not 0 < partial <= 1:
        raise BadField("rotary_dim", f"{partial} must be a share of the head, above 0")
    return dict(
        vocab_size=whole(config.get("vocab_size"), "vocab_size"),
        hidden_size=hidden,
        intermediate_size=whole(config.get("intermediate_size") or 0, "intermediate_size", 0),
        num_layers=whole(config.get("num_hidden_layers"), "num_layers"),
        num_heads=heads,
        num_kv_heads=whole(config.get("num_key_value_heads") or heads, "num_kv_heads"),
        head_dim=head_dim,
        rope_theta=real(theta if theta is not None else 10000.0, "rope_theta"),
        rms_norm_eps=real(config.get("rms_norm_eps", 1e-6), "rms_norm_eps"),
        max_position=context_length(config),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        attention_bias=False,
        rope_scaling=rope_scaling(params, config),
        rotary_dim=0 if partial == 1.0 else int(head_dim * partial),
    )


def head_size(given: Any, hidden: int, heads: int) -> int:
    """head_dim as given, or hidden / heads where it is implied (then heads must divide it)."""
    if given:
        return whole(given, "head_dim")
    if hidden % heads:
        raise BadField("num_heads", f"{heads} does not divide hidden size {hidden}")
    return hidden // heads


def sliding(config: dict, layer_types: list[str] | None) -> dict:
    """sliding_window and sliding_layers from a window size and per-layer kinds."""
    window = whole(config.get("sliding_window") or 0, "sliding_window", low=0)
    if not window or not layer_types:
        return {}
    layers = tuple(i for i, kind in enumerate(layer_types) if kind == "sliding_attention")
    return {"sliding_window": window, "sliding_layers": layers} if layers else {}


def every_layer_slides(config: dict) -> dict:
    """A window over every layer (Mistral, Mixtral, Phi-3), where config.json sets one."""
    n = whole(config.get("num_hidden_layers"), "num_layers")
    return sliding(config, config.get("layer_types") or ["sliding_attention"] * n)


def check_act(config: dict, key: str = "hidden_act", allowed=("silu",)) -> str:
    act = config.get(key) or "silu"
    if act not in allowed:
        raise NotImplementedError(f"{key} {act!r} is not supported (supported: {list(allowed)})")
    return act


# ---------------------------------------------------------------------------------------------
# what every family shares from GGUF metadata


def gguf_shapes(meta: GGUFMeta, vocab_size: int) -> dict:
    hidden = whole(meta.key("embedding_length"), "hidden_size")
    heads = whole(meta.key("attention.head_count"), "num_heads")
    head_dim = head_size(meta.key("attention.key_length", 0), hidden, heads)
    rot = whole(meta.key("rope.dimension_count", head_dim), "rotary_dim")
    return dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=whole(meta.key("feed_forward_length", 0), "intermediate_size", 0),
        num_layers=whole(meta.key("block_count"), "num_layers"),
        num_heads=heads,
        num_kv_heads=whole(meta.key("attention.head_count_kv", heads), "num_kv_heads"),
        head_dim=head_dim,
        rope_theta=real(meta.key("rope.freq_base", 10000.0), "rope_theta"),
        rms_norm_eps=real(meta.key("attention.layer_norm_rms_epsilon"), "rms_norm_eps"),
        max_position=whole(meta.key("context_length"), "max_position"),
        tie_word_embeddings="output.weight" not in meta.tensors,
        attention_bias="blk.0.attn_q.bias" in meta.tensors,
        o_bias="blk.0.attn_output.bias" in meta.tensors,
        rotary_dim=0 if rot == head_dim else rot,
        rope_scaling=gguf_rope(meta),
    )


def gguf_rope(meta: GGUFMeta) -> dict | None:
    """RoPE scaling from GGUF metadata: linear and YaRN as keys, llama3's frequencies as the
    rope_freqs tensor llama.cpp divides them by."""
    kind = meta.key("rope.scaling.type", "none")
    if "rope_freqs.weight" in meta.tensors:
        if kind not in ("none", "linear") or float(meta.key("rope.scaling.factor", 1.0)) != 1.0:
            raise NotImplementedError(f"{meta.path}: rope_freqs beside {kind!r} scaling")
        return {"rope_type": "factors", "factors": meta.read_f32("rope_freqs.weight").tolist()}
    if kind == "none":
        return None
    if kind not in ("linear", "yarn"):
        raise NotImplementedError(f"{meta.path}: GGUF rope scaling {kind!r} is not supported")
    factor = real(meta.key("rope.scaling.factor"), "rope_scaling.factor")
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    original = meta.key("rope.scaling.original_context_length")
    return {
        "rope_type": "yarn",
        "factor": factor,
        "original_max_position_embeddings": whole(
            original, "rope_scaling.original_max_position_embeddings"
        ),
        "truncate": True,
    }


def gguf_experts(meta: GGUFMeta) -> dict:
    """The routed experts' counts and sizes; {} for a dense file."""
    count = whole(meta.key("expert_count", 0), "num_experts", 0)
    if not count:
        return {}
    return dict(
        num_experts=count,
        num_experts_per_tok=whole(meta.key("expert_used_count"), "num_experts_per_tok", 0),
        moe_intermediate_size=whole(
            meta.key("expert_feed_forward_length", 0), "moe_intermediate_size", 0
        ),
    )
