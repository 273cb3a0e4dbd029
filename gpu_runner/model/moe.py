"""Mixture-of-experts MLP: a router picks each token's top-k experts; the experts run as one
operator, gapless::moe_experts, so a compiled step keeps the layer whole whatever the routing.

On cpu the operator loops over the experts a step selected, each over its tokens. Elsewhere
(cuda) it sorts the token-expert pairs by expert and runs both products as grouped GEMMs over
the sorted rows, with no host sync, so CUDA graphs capture it; where the grouped GEMM cannot
take the shapes, a loop over every expert, masked. Which cuda path is faster is to be measured
on a GPU (marked: MEASURE)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gapless.common.families.base import ModelArch
from gapless.gpu_runner.model.layers import ACTIVATIONS, MLP
from gapless.gpu_runner.model.projection import StepContext


def _expert(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, act: str) -> torch.Tensor:
    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
    return F.linear(ACTIVATIONS[act](gate) * up, down)


def experts_loop(x, ids, weights, gate_up, down, act: str) -> torch.Tensor:
    """The selected experts one by one, each over the tokens routed to it (a host sync)."""
    k = ids.shape[1]
    flat = ids.reshape(-1)  # [T * k]: token t's j-th expert at t * k + j
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()
    w = weights.reshape(-1)
    out = torch.zeros_like(x)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        pairs = order[start : start + n]
        tokens = pairs // k
        y = _expert(x[tokens], gate_up[e], down[e], act) * w[pairs, None]
        out.index_add_(0, tokens, y.to(out.dtype))
        start += n
    return out


def experts_grouped(x, ids, weights, gate_up, down, act: str) -> torch.Tensor:
    """Both products as grouped GEMMs over the token-expert pairs sorted by expert; every
    shape is fixed by the step's size, and nothing waits for the host."""
    num_experts, k = gate_up.shape[0], ids.shape[1]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int32, device=x.device)
    counts.index_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    ends = counts.cumsum(0, dtype=torch.int32)  # [E]: where each expert's rows end
    tokens = order // k
    h = torch._grouped_mm(x[tokens], gate_up.transpose(1, 2), offs=ends)  # [T * k, 2I]
    gate, up = h.chunk(2, dim=-1)
    y = torch._grouped_mm(ACTIVATIONS[act](gate) * up, down.transpose(1, 2), offs=ends)
    y = y * weights.reshape(-1)[order, None]
    return torch.zeros_like(x).index_add_(0, tokens, y.to(x.dtype))


def experts_masked(x, ids, weights, gate_up, down, act: str) -> torch.Tensor:
    """Every expert over every token, weighted by its routing weight (0 where not routed)."""
    out = torch.zeros_like(x)
    for e in range(gate_up.shape[0]):
        w = (weights * (ids == e)).sum(-1, keepdim=True)  # [T, 1]
        out += (_expert(x, gate_up[e], down[e], act) * w).to(x.dtype)
    return out


def _grouped_fits(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    # the cuda kernels (Hopper on) take bfloat16 rows of 16-byte multiples, row- or
    # column-major: the experts' weights transposed are column-major as stored
    if not hasattr(torch, "_grouped_mm") or x.dtype != torch.bfloat16:
        return False
    if x.device.type == "cuda" and torch.cuda.get_device_capability(x.device) < (9, 0):
        return False
    sizes = (gate_up.shape[1], gate_up.shape[2], down.shape[1])
    return all(s % 8 == 0 for s in sizes)


@torch.library.custom_op("gapless::moe_experts", mutates_args=())
def moe_experts(
    x: torch.Tensor,  # [T, H]
    ids: torch.Tensor,  # [T, k] long: each token's experts
    weights: torch.Tensor,  # [T, k] float32: their routing weights
    gate_up: torch.Tensor,  # [E, 2I, H]: gate's rows, then up's
    down: torch.Tensor,  # [E, H, I]
    act: str,
) -> torch.Tensor:  # [T, H]
    # MEASURE: grouped GEMM against the masked loop (and flashinfer's fused MoE) on a GPU
    if _grouped_fits(x, gate_up, down):
        return experts_grouped(x, ids, weights, gate_up, down, act)
    return experts_masked(x, ids, weights, gate_up, down, act)


@moe_experts.register_kernel("cpu")
def _(x, ids, weights, gate_up, down, act) -> torch.Tensor:
    return experts_loop(x, ids, weights, gate_up, down, act)


@moe_experts.register_fake
def _(x, ids, weights, gate_up, down, act) -> torch.Tensor:
    return torch.empty_like(x)


class Experts(nn.Module):
    """The routed experts' weights, stacked: parameters mlp.experts.gate_up_proj, down_proj."""

    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        e, i, h = arch.num_experts, arch.moe_intermediate_size, arch.hidden_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))


class MoE(nn.Module):
    """Top-k routing (softmax over the experts in float32, renormalized where the family
    does), the routed experts, and a shared expert gated by a sigmoid where it has one."""

    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        self.top_k = arch.num_experts_per_tok
        self.renormalize = arch.norm_topk_prob
        self.act = arch.hidden_act
        self.gate = nn.Linear(arch.hidden_size, arch.num_experts, bias=False)  # the router
        self.experts = Experts(arch)
        self.shared_expert = self.shared_expert_gate = None
        if arch.shared_expert_intermediate_size:
            size = arch.shared_expert_intermediate_size
            self.shared_expert = MLP(arch.hidden_size, size, arch.hidden_act)
            self.shared_expert_gate = nn.Linear(arch.hidden_size, 1, bias=False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, k] expert ids (long) and weights (float32) of each token."""
        probs = self.gate(x).float().softmax(dim=-1)  # [T, E]
        weights, ids = probs.topk(self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids, weights

    def forward(self, x: torch.Tensor, ctx: StepContext | None = None) -> torch.Tensor:
        ids, weights = self.route(x)
        w = self.experts
        out = torch.ops.gapless.moe_experts(x, ids, weights, w.gate_up_proj, w.down_proj, self.act)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x, ctx)
        return out
