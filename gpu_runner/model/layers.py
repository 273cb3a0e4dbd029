"""The shared layers every family's decoder is made of: RMSNorm (plain or Gemma's 1 + w),
attention over the paged KV cache (biases, q/k head norms, sliding window, soft-capping and
the softmax scale as options) and the gated MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gapless.common.families.base import ModelArch
from gapless.gpu_runner.attention import AttentionMeta
from gapless.gpu_runner.model.projection import StepContext, project, projection
from gapless.gpu_runner.model.rope import rotate

ACTIVATIONS = {
    "silu": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, offset: float = 0.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.offset = offset  # Gemma: scaled by 1 + weight, in float32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # why fp32: matches the reference's numerics in bf16
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (h * (self.offset + self.weight.float())).to(x.dtype)
        return self.weight * h.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, arch: ModelArch, layer: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            arch.num_heads,
            arch.num_kv_heads,
            arch.head_dim,
        )
        # q's rows, then k's and v's; a fused layer's parts are split by its module's sizes
        self.sizes = [self.num_heads * self.head_dim] + [self.num_kv_heads * self.head_dim] * 2
        self.qkv_proj = projection(arch.hidden_size, sum(self.sizes), arch.attention_bias)
        self.o_proj = projection(self.num_heads * self.head_dim, arch.hidden_size, arch.o_bias)
        self.q_norm = self.k_norm = None
        if arch.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, arch.rms_norm_eps, arch.norm_offset)
            self.k_norm = RMSNorm(self.head_dim, arch.rms_norm_eps, arch.norm_offset)
        self.window = arch.window(layer)  # keys attended, its own included; 0: all
        self.softcap = arch.attn_softcap

    def forward(
        self, x, cos, sin, kv: torch.Tensor, meta: AttentionMeta, ctx: StepContext | None = None
    ) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = project(self.qkv_proj, x, ctx).split(self.sizes, dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.window or self.softcap:
            o = meta.attend(q, k, v, kv[0], kv[1], self.window, self.softcap)
        else:
            o = meta.attend(q, k, v, kv[0], kv[1])
        return project(self.o_proj, o.reshape(t, -1), ctx)


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, act: str) -> None:
        super().__init__()
        self.sizes = [intermediate] * 2  # gate's rows, then up's
        self.gate_up_proj = projection(hidden, sum(self.sizes), False)
        self.down_proj = projection(intermediate, hidden, False)
        self.act = ACTIVATIONS[act]

    def forward(self, x: torch.Tensor, ctx: StepContext | None = None) -> torch.Tensor:
        gate, up = project(self.gate_up_proj, x, ctx).split(self.sizes, dim=-1)
        return project(self.down_proj, self.act(gate) * up, ctx)
