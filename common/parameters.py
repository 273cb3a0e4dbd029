"""Every parameter a decoder holds, by Hugging Face's name: its shape and the ModelArch fields
that size it, and the names llama.cpp gives them in GGUF files. No torch here: the files are
held to these before anything is built (common/model_check.py), and the loader reads them by
these names (gpu_runner/model/weights.py).
"""

from __future__ import annotations

from collections.abc import Iterator

import msgspec

from gapless.common.families.base import ModelArch

# GGUF tensor name (after "blk.{i}.") -> HF name (after "model.layers.{i}.")
GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_exps.weight": "mlp.experts.gate_proj",  # [E, I, H]
    "ffn_up_exps.weight": "mlp.experts.up_proj",
    "ffn_down_exps.weight": "mlp.experts.down_proj",  # [E, H, I]
}
GGUF_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# GGUF tensors the loader reads elsewhere or not at all (RoPE factors: families read them)
GGUF_SKIPPED = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


def hf_name(gguf_name: str, arch_names: dict[str, str] | None = None) -> str | None:
    """Our name of a GGUF tensor; arch_names: the family's own (families' gguf_names)."""
    if gguf_name in GGUF_NAMES:
        return GGUF_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)  # ["blk", "{i}", rest]
    if len(parts) != 3 or parts[0] != "blk":
        return None
    table = {**GGUF_LAYER_NAMES, **(arch_names or {})}
    return f"model.layers.{parts[1]}.{table[parts[2]]}" if parts[2] in table else None


class Param(msgspec.Struct, frozen=True):
    shape: tuple[int, ...]
    fields: tuple[str, ...]  # the ModelArch fields its shape comes from


def parameter_shapes(
    arch: ModelArch, fused: bool = False, joined_qkv: bool | None = None, stacked: bool = False
) -> dict[str, Param]:
    """Every parameter the model needs, in Hugging Face naming, in load order. fused: q/k/v
    and gate/up come joined (qkv_proj, gate_up_proj; joined_qkv overrides for q/k/v); stacked:
    each layer's experts come as one tensor per projection, as in GGUF files (which keep the
    shared expert's gate as a vector)."""
    return dict(iter_parameters(arch, fused, joined_qkv, stacked))


def iter_parameters(
    arch: ModelArch, fused: bool = False, joined_qkv: bool | None = None, stacked: bool = False
) -> Iterator[tuple[str, Param]]:
    """parameter_shapes one at a time, so that a caller can stop at a count."""
    a = arch
    joined_qkv = fused if joined_qkv is None else joined_qkv
    h, d, q, kv = a.hidden_size, a.head_dim, a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
    embed = Param((a.vocab_size, h), ("vocab_size", "hidden_size"))
    norm = Param((h,), ("hidden_size",))
    heads = ("num_heads", "num_kv_heads", "head_dim")
    attn = {"qkv": Param((q + 2 * kv, h), (*heads, "hidden_size"))} if joined_qkv else {
        "q": Param((q, h), ("num_heads", "head_dim", "hidden_size")),
        "k": Param((kv, h), ("num_kv_heads", "head_dim", "hidden_size")),
        "v": Param((kv, h), ("num_kv_heads", "head_dim", "hidden_size")),
    }  # fmt: skip
    yield "model.embed_tokens.weight", embed
    for i in range(a.num_layers):
        p = f"model.layers.{i}."
        yield from ((p + f"self_attn.{x}_proj.weight", w) for x, w in attn.items())
        yield p + "self_attn.o_proj.weight", Param((h, q), ("hidden_size", "num_heads", "head_dim"))
        if a.attention_bias:
            yield from ((p + f"self_attn.{x}_proj.bias", Param(w.shape[:1], w.fields[:-1]))
                        for x, w in attn.items())  # fmt: skip
        if a.o_bias:
            yield p + "self_attn.o_proj.bias", norm
        if a.qk_norm:
            head_norm = Param((d,), ("head_dim",))
            yield p + "self_attn.q_norm.weight", head_norm
            yield p + "self_attn.k_norm.weight", head_norm
        yield from _mlp(a, i, p + "mlp.", fused, stacked)
        norms = ["input_layernorm", "post_attention_layernorm"]
        if a.sandwich_norm:
            norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
        yield from ((p + n + ".weight", norm) for n in norms)
    yield "model.norm.weight", norm
    if not a.tie_word_embeddings:
        yield "lm_head.weight", embed


def _dense(p: str, h: int, size: int, field: str, fused: bool) -> Iterator[tuple[str, Param]]:
    rows = Param((size, h), (field, "hidden_size"))
    parts = {"gate_up": Param((2 * size, h), rows.fields)} if fused else {"gate": rows, "up": rows}
    parts["down"] = Param((h, size), ("hidden_size", field))
    return ((p + f"{x}_proj.weight", w) for x, w in parts.items())


def _mlp(
    a: ModelArch, layer: int, p: str, fused: bool, stacked: bool
) -> Iterator[tuple[str, Param]]:
    h = a.hidden_size
    if not a.is_moe(layer):
        yield from _dense(p, h, a.intermediate_size, "intermediate_size", fused)
        return
    e, size = a.num_experts, a.moe_intermediate_size
    yield p + "gate.weight", Param((e, h), ("num_experts", "hidden_size"))
    if stacked:
        fields = ("num_experts", "moe_intermediate_size", "hidden_size")
        yield p + "experts.gate_proj", Param((e, size, h), fields)
        yield p + "experts.up_proj", Param((e, size, h), fields)
        yield p + "experts.down_proj", Param((e, h, size), fields)
    else:
        for j in range(e):
            yield from _dense(f"{p}experts.{j}.", h, size, "moe_intermediate_size", False)
    if a.shared_expert_intermediate_size:
        field = "shared_expert_intermediate_size"
        yield from _dense(p + "shared_expert.", h, a.shared_expert_intermediate_size, field, fused)
        yield p + "shared_expert_gate.weight", Param((h,) if stacked else (1, h), ("hidden_size",))


def parameter_names(
    arch: ModelArch, fused: bool = False, joined_qkv: bool | None = None, stacked: bool = False
) -> list[str]:
    """parameter_shapes' names."""
    return list(parameter_shapes(arch, fused, joined_qkv, stacked))
