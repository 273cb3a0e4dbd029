"""Timing profiles of the `sim` device: one accelerator setup and one model each.

A step's device time is a roofline estimate plus fixed overheads:

    t = max(compute_s, memory_s) + launch + layers * per_layer + all_reduce (tp > 1)
    compute_s = (2 * params * tokens + 4 * layers * heads * head_dim * sum_q ctx(q)) / tp
                / (peak_flops * mfu)
    memory_s  = (weight_bytes + sum_entries ctx * kv_bytes_per_token) / tp
                / (hbm_bandwidth * bandwidth_efficiency)

where ctx(q) is the number of keys query token q attends to. Figures from this model are
simulated: every number derived from it is reported as `sim`. docs/sim-profiles.md gives the
sources of each profile's numbers and the calibration of the efficiency factors.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from gapless.common.config import max_useful_blocks
from gapless.common.step_costs import table_sizes

GB = 10**9
GIB = 2**30
TB = 10**12


def llama_params(
    vocab: int,
    hidden: int,
    layers: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    ffn: int,
    tied: bool = False,
) -> int:
    """Parameters of a Llama decoder (norm weights included); `tied`: the LM head is the
    embedding table."""
    attn = hidden * head_dim * (2 * heads + 2 * kv_heads)  # q, o: heads; k, v: kv_heads
    mlp = 3 * hidden * ffn  # gate, up, down
    embeddings = (1 if tied else 2) * vocab * hidden
    return embeddings + layers * (attn + mlp + 2 * hidden) + hidden


@dataclass(frozen=True)
class SimProfile:
    name: str
    description: str  # what is modelled and where its numbers come from
    # accelerator (one GPU)
    peak_flops: float  # FLOP/s, dense, at the weights' precision (datasheet)
    hbm_bandwidth: float  # bytes/s (datasheet)
    memory_bytes: int  # device memory
    memory_utilization: float  # share of memory the engine takes (weights + KV)
    mfu: float  # share of peak_flops reached by large GEMMs: calibrated, see the docs
    bandwidth_efficiency: float  # share of hbm_bandwidth reached by streaming reads
    # model (whole model, all GPUs together)
    num_params: int
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    weight_bytes: int  # num_params * bytes per weight
    kv_dtype_bytes: int  # bytes per K or V element in the cache
    # tensor parallelism: weights, heads and KV split over tp GPUs
    tp: int = 1
    allreduce_bandwidth: float = 450 * GB  # bytes/s per direction per GPU (NVLink 4)
    allreduce_latency_us: float = 8.0  # fixed cost of one small all-reduce
    # fixed costs
    launch_overhead_us: float = 40.0  # per step: graph launch, input copies, sampler
    layer_overhead_us: float = 5.0  # per layer, decode-only steps (CUDA graph replay)
    eager_layer_overhead_us: float = 15.0  # per layer, steps with prompt tokens (no graph)
    d2h_us: float = 15.0  # sampled ids device -> host after the step ends
    # measured: gapless's own runner on this card, step time over this model's at the same
    # step (the GPU check's report, bench/gpu_check, emits them); 1.0 is the model above
    decode_scale: float = 1.0  # decode-only steps
    prefill_scale: float = 1.0  # steps that carry prompt tokens
    # speculation: a verify step costs its tokens (drafts included) like any step, plus a
    # sampling round per draft position; each draft is accepted with this probability after
    # the one before it was (a stated rate, not a model's: sim drafts carry no text)
    verify_round_us: float = 10.0
    spec_acceptance: float = 0.7

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token over all layers, on one GPU."""
        kv_heads = max(1, self.num_kv_heads // self.tp)
        return 2 * self.num_layers * kv_heads * self.head_dim * self.kv_dtype_bytes

    @property
    def weight_bytes_per_gpu(self) -> float:
        return self.weight_bytes / self.tp


_H100 = dict(
    peak_flops=989.4 * TB,  # H100 SXM5 dense BF16 (1979 with sparsity)
    hbm_bandwidth=3.35 * TB,  # HBM3
    memory_bytes=80 * GIB,
    memory_utilization=0.9,
    mfu=0.6,
    bandwidth_efficiency=0.85,
)
_A100 = dict(
    peak_flops=312 * TB,  # A100 SXM4 dense BF16
    hbm_bandwidth=2.039 * TB,  # A100 80GB SXM4, HBM2e
    memory_bytes=80 * GIB,
    memory_utilization=0.9,
    mfu=0.6,
    bandwidth_efficiency=0.85,
)
# (vocab, hidden, layers, heads, kv_heads, head_dim, ffn) from each model's config.json
_LLAMA_1_3B = (32000, 2048, 24, 16, 16, 128, 5504)  # princeton-nlp/Sheared-LLaMA-1.3B
_LLAMA3_8B = (128256, 4096, 32, 32, 8, 128, 14336)  # meta-llama/Meta-Llama-3-8B
_LLAMA3_70B = (128256, 8192, 80, 64, 8, 128, 28672)  # meta-llama/Meta-Llama-3-70B
_LLAMA3_2_1B = (128256, 2048, 16, 32, 8, 64, 8192)  # meta-llama/Llama-3.2-1B, tied embeddings


def _model(
    shape: tuple[int, ...], weight_dtype_bytes: float, kv_dtype_bytes: int, tied: bool = False
) -> dict:
    vocab, hidden, layers, heads, kv_heads, head_dim, ffn = shape
    params = llama_params(vocab, hidden, layers, heads, kv_heads, head_dim, ffn, tied)
    return dict(
        num_params=params,
        num_layers=layers,
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        weight_bytes=int(params * weight_dtype_bytes),
        kv_dtype_bytes=kv_dtype_bytes,
    )


PROFILES: dict[str, SimProfile] = {
    p.name: p
    for p in (
        SimProfile(
            name="a100-llama-1.3b",
            description="A100-80GB SXM, Llama-architecture 1.3B (Sheared-LLaMA-1.3B shapes), bf16",
            **_A100,
            **_model(_LLAMA_1_3B, 2, 2),
            launch_overhead_us=50.0,
            layer_overhead_us=6.0,
            eager_layer_overhead_us=18.0,
        ),
        SimProfile(
            name="a100-llama3-8b",
            description="A100-80GB SXM, Llama-3-8B, bf16",
            **_A100,
            **_model(_LLAMA3_8B, 2, 2),
            launch_overhead_us=50.0,
            layer_overhead_us=6.0,
            eager_layer_overhead_us=18.0,
        ),
        SimProfile(
            name="h100-llama3-8b",
            description="H100 SXM 80GB, Llama-3-8B, bf16 weights and KV cache",
            **_H100,
            **_model(_LLAMA3_8B, 2, 2),
        ),
        SimProfile(
            name="h100-llama3.2-1b",
            description="H100 SXM 80GB, Llama-3.2-1B (tied embeddings), bf16: ~1 ms decode steps",
            **_H100,
            **_model(_LLAMA3_2_1B, 2, 2, tied=True),
        ),
        SimProfile(
            name="h100-llama3-8b-fp8",
            description="H100 SXM 80GB, Llama-3-8B, fp8 weights (e4m3) and fp8 KV cache",
            **{**_H100, "peak_flops": 1978.9 * TB},  # dense FP8
            **_model(_LLAMA3_8B, 1, 1),
        ),
        SimProfile(
            name="h100-llama3-70b-tp4",
            description="4 x H100 SXM 80GB over NVLink 4, Llama-3-70B, bf16, tensor parallel 4",
            **_H100,
            **_model(_LLAMA3_70B, 2, 2),
            tp=4,
        ),
    )
}


def profile_fields(profile: SimProfile) -> dict:
    """The profile as JSON-ready fields; SimProfile(**fields) gives it back."""
    return dataclasses.asdict(profile)


def list_profiles() -> list[str]:
    return sorted(PROFILES)


def get_profile(name: str) -> SimProfile:
    if name not in PROFILES:
        raise ValueError(f"unknown sim profile {name!r} (known: {', '.join(list_profiles())})")
    return PROFILES[name]


@dataclass(frozen=True)
class StepCost:
    """Modelled device time of one step and its parts, seconds (sim)."""

    compute_s: float
    memory_s: float
    overhead_s: float  # launch and per-layer costs
    comm_s: float  # tensor-parallel all-reduces
    scale: float = 1.0  # the profile's measured decode_scale or prefill_scale

    @property
    def total_s(self) -> float:
        return (max(self.compute_s, self.memory_s) + self.overhead_s + self.comm_s) * self.scale


def step_cost(
    profile: SimProfile,
    num_tokens: int,
    num_seqs: int,
    total_context: int,
    num_prefill_tokens: int = 0,
    attended_keys: int | None = None,
) -> StepCost:
    """Device time of a step of num_tokens query tokens over num_seqs entries.

    total_context: sum over entries of their context length after the step (cached + new).
    attended_keys: sum over query tokens of the keys each attends to; when not given, it is
    exact for entries of equal token counts whose tokens end their context (decodes, chunks).
    num_prefill_tokens: prompt tokens in the step; a step with any runs eagerly (decode-only
    steps replay a CUDA graph), which costs more per layer.
    """
    p = profile
    if num_tokens == 0:
        return StepCost(0.0, 0.0, 0.0, 0.0)
    if attended_keys is None:
        per_seq = num_tokens / max(num_seqs, 1)
        attended_keys = int(per_seq * total_context - num_seqs * per_seq * (per_seq - 1) / 2)
    flops = 2.0 * p.num_params * num_tokens
    flops += 4.0 * p.num_layers * p.num_heads * p.head_dim * attended_keys
    compute_s = flops / p.tp / (p.peak_flops * p.mfu)
    # weights once, every entry's cached K/V once, the new tokens' K/V written
    kv_bytes = (total_context + num_tokens) * p.kv_bytes_per_token
    memory_s = (p.weight_bytes_per_gpu + kv_bytes) / (p.hbm_bandwidth * p.bandwidth_efficiency)
    per_layer = p.eager_layer_overhead_us if num_prefill_tokens else p.layer_overhead_us
    overhead_s = (p.launch_overhead_us + p.num_layers * per_layer) * 1e-6
    comm_s = 0.0
    if p.tp > 1:
        # two ring all-reduces per layer (after attention, after the MLP) of bf16 activations
        message = num_tokens * p.hidden_size * 2
        ring = 2 * (p.tp - 1) / p.tp * message / p.allreduce_bandwidth
        comm_s = 2 * p.num_layers * (p.allreduce_latency_us * 1e-6 + ring)
    scale = p.prefill_scale if num_prefill_tokens else p.decode_scale
    return StepCost(compute_s, memory_s, overhead_s, comm_s, scale)


def step_time(
    profile: SimProfile,
    num_tokens: int,
    num_seqs: int,
    total_context: int,
    num_prefill_tokens: int = 0,
    attended_keys: int | None = None,
) -> float:
    """Seconds (sim) the device spends on one step; see step_cost."""
    cost = step_cost(
        profile, num_tokens, num_seqs, total_context, num_prefill_tokens, attended_keys
    )
    return cost.total_s


def kv_bytes_per_block(profile: SimProfile, block_size: int) -> int:
    return profile.kv_bytes_per_token * block_size


def num_kv_blocks(
    profile: SimProfile, block_size: int, max_num_seqs: int, max_model_len: int
) -> int:
    """Blocks that fit next to the weights on one GPU, capped at what max_num_seqs full
    contexts need, plus the reserved block 0 (the same cap as the cpu runner)."""
    free = profile.memory_bytes * profile.memory_utilization - profile.weight_bytes_per_gpu
    fit = max(0, math.floor(free / kv_bytes_per_block(profile, block_size)))
    return int(min(fit, max_useful_blocks(max_num_seqs, max_model_len, block_size)))


def step_costs(profile: SimProfile, max_tokens: int, scale: float = 1.0):
    """(tokens, seconds): the modelled time of a decode-shaped step of n tokens for n = 1, 2,
    4, ... max_tokens, the table speculation's cost model reads (core/spec_cost.py; sim)."""
    tokens = table_sizes(max_tokens)
    return tokens, [scale * step_time(profile, n, 1, n) for n in tokens]
