"""The floor under a step: the bytes it must move over the card's HBM bandwidth, and the FLOPs
it must do over the card's bf16 matmul peak. Pure arithmetic over the model's shapes
(ModelArch) and the step's entries; no torch.

A step reads every weight it uses once (a routed expert only if some token picked it), the
cached K/V each entry attends to once per layer, and writes its new tokens' K/V. Its FLOPs are
the matmuls (2 per weight per token; the LM head only for the rows it samples) and attention
(QK and PV: 4 per head dimension per key a query attends to).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from gapless.common.families.base import ModelArch

GB = 10**9
TB = 10**12

# torch.cuda.get_device_name() substring -> (HBM bytes/s, dense bf16 FLOP/s), vendor datasheets;
# first match wins, so the specific names come before the general ones
CARDS: tuple[tuple[str, float, float], ...] = (
    ("GH200", 4.0 * TB, 989.4 * TB),  # the 96 GB HBM3 module
    ("H200", 4.8 * TB, 989.4 * TB),
    ("H100 NVL", 3.9 * TB, 835.0 * TB),
    ("H100 PCIe", 2.0 * TB, 756.0 * TB),
    ("H100", 3.35 * TB, 989.4 * TB),  # SXM5 80 GB, HBM3
    ("A100-SXM4-80GB", 2.039 * TB, 312.0 * TB),
    ("A100 80GB PCIe", 1.935 * TB, 312.0 * TB),
    ("A100", 1.555 * TB, 312.0 * TB),  # 40 GB
    ("L40S", 0.864 * TB, 362.0 * TB),
)


@dataclass(frozen=True)
class Card:
    name: str  # as torch names it
    hbm_bandwidth: float | None  # bytes/s, datasheet; None: not in CARDS
    bf16_peak: float | None  # FLOP/s, dense, datasheet


def card(name: str) -> Card:
    """The datasheet figures of the card torch calls `name`."""
    for key, bandwidth, peak in CARDS:
        if key in name:
            return Card(name, bandwidth, peak)
    return Card(name, None, None)


@dataclass(frozen=True)
class LayerParams:
    """One decoder layer's parameters."""

    dense: int  # matmul weights every token uses: q, k, v, o; a dense MLP or router + shared
    expert: int  # one routed expert's matmul weights; 0 in a dense layer
    num_experts: int
    top_k: int
    small: int  # norms and biases: read every step, no matmul


def layer_params(arch: ModelArch, layer: int) -> LayerParams:
    h, d = arch.hidden_size, arch.head_dim
    q, kv = arch.num_heads * d, arch.num_kv_heads * d
    attn = h * (q + 2 * kv) + q * h
    small = (q + 2 * kv if arch.attention_bias else 0) + (h if arch.o_bias else 0)
    small += 2 * d if arch.qk_norm else 0
    small += (4 if arch.sandwich_norm else 2) * h
    if not arch.is_moe(layer):
        return LayerParams(attn + 3 * h * arch.intermediate_size, 0, 0, 0, small)
    dense = attn + arch.num_experts * h  # the router
    if arch.shared_expert_intermediate_size:
        dense += 3 * h * arch.shared_expert_intermediate_size + h  # and its sigmoid gate
    expert = 3 * h * arch.moe_intermediate_size
    return LayerParams(dense, expert, arch.num_experts, arch.num_experts_per_tok, small)


def model_params(arch: ModelArch) -> int:
    """Every parameter the model holds (a tied embedding once)."""
    layers = sum(
        p.dense + p.expert * p.num_experts + p.small
        for p in (layer_params(arch, i) for i in range(arch.num_layers))
    )
    embeddings = (1 if arch.tie_word_embeddings else 2) * arch.vocab_size * arch.hidden_size
    return layers + embeddings + arch.hidden_size  # the final norm


def expected_experts(num_experts: int, top_k: int, num_tokens: int) -> float:
    """Distinct experts num_tokens tokens pick, top_k each, if each picks uniformly."""
    if not num_experts:
        return 0.0
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** num_tokens)


@dataclass(frozen=True)
class Entry:
    """One entry of a step: a prompt chunk or a decode."""

    num_tokens: int  # query tokens this step
    context: int  # keys in its cache after the step: cached + new
    sampled: bool = True  # its last token goes through the LM head


def decode_entries(batch: int, context: int) -> list[Entry]:
    """A steady decode step: `batch` entries of one token at `context` keys each."""
    return [Entry(1, context)] * batch


def keys_attended(num_tokens: int, context: int, window: int) -> int:
    """Keys the queries of a chunk of num_tokens ending at `context` attend to in all (causal;
    window: each query sees at most this many keys, its own included; 0: all)."""
    before = context - num_tokens
    if not window or window >= context:
        return num_tokens * before + num_tokens * (num_tokens + 1) // 2
    full = min(max(window - before, 0), num_tokens)  # queries whose keys fit in the window
    return full * before + full * (full + 1) // 2 + (num_tokens - full) * window


def keys_read(num_tokens: int, context: int, window: int) -> int:
    """Distinct keys a chunk's queries read from the cache (window as in keys_attended)."""
    return context if not window else min(context, num_tokens + window - 1)


@dataclass(frozen=True)
class StepCost:
    weight_bytes: float  # weights read (expected, where experts are routed)
    kv_read_bytes: float
    kv_write_bytes: float
    flops: float

    @property
    def bytes(self) -> float:
        return self.weight_bytes + self.kv_read_bytes + self.kv_write_bytes


def step_cost(
    arch: ModelArch, entries: Sequence[Entry], weight_bytes: int = 2, kv_bytes: int = 2
) -> StepCost:
    """What a step of these entries must read, write and compute (bf16 weights and K/V by
    default: 2 bytes each)."""
    tokens = sum(e.num_tokens for e in entries)
    rows = sum(1 for e in entries if e.sampled)
    h, v = arch.hidden_size, arch.vocab_size
    per_key = 2 * arch.num_kv_heads * arch.head_dim * kv_bytes  # K and V of one layer
    weights = float(min(tokens, v) * h + h)  # embedding rows, final norm
    weights += v * h if rows else 0  # the LM head (the embedding table when tied)
    flops = 2.0 * v * h * rows
    kv_read = kv_write = 0.0
    for i in range(arch.num_layers):
        p = layer_params(arch, i)
        touched = expected_experts(p.num_experts, p.top_k, tokens)
        weights += p.dense + p.small + touched * p.expert
        flops += 2.0 * tokens * (p.dense + p.top_k * p.expert)
        window = arch.window(i)
        attended = sum(keys_attended(e.num_tokens, e.context, window) for e in entries)
        flops += 4.0 * arch.num_heads * arch.head_dim * attended
        kv_read += per_key * sum(keys_read(e.num_tokens, e.context, window) for e in entries)
        kv_write += per_key * tokens
    return StepCost(weights * weight_bytes, kv_read, kv_write, flops)


@dataclass(frozen=True)
class Floors:
    hbm_s: float  # bytes / bandwidth
    flop_s: float  # FLOPs / peak

    @property
    def floor_s(self) -> float:
        return max(self.hbm_s, self.flop_s)

    @property
    def bound(self) -> str:
        return "memory" if self.hbm_s >= self.flop_s else "compute"


def floors(cost: StepCost, bandwidth: float, peak: float) -> Floors:
    """The step's floors on a card of `bandwidth` bytes/s and `peak` FLOP/s."""
    assert bandwidth > 0 and peak > 0, "a card needs a bandwidth and a peak"
    return Floors(cost.bytes / bandwidth, cost.flops / peak)


def ratio(measured_s: float | None, floor_s: float) -> float | None:
    """measured / floor, None when there is no measurement."""
    if measured_s is None or not math.isfinite(measured_s) or floor_s <= 0:
        return None
    return measured_s / floor_s
