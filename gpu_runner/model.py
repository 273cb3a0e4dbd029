"""Llama-architecture decoder (Llama 2/3, SmolLM2, Mistral, Qwen2) over a paged KV cache."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from gapless.core.common.model_files import ModelArch
from gapless.gpu_runner.attention import AttentionMeta


def rope_inv_freq(arch: ModelArch) -> torch.Tensor:  # [head_dim // 2] float32
    d = arch.head_dim
    inv = 1.0 / (arch.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    rs = arch.rope_scaling
    if rs and rs.get("rope_type", rs.get("type")) == "llama3":
        factor = rs["factor"]
        low, high = rs["low_freq_factor"], rs["high_freq_factor"]
        old_ctx = rs["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old_ctx / low, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
        inv = torch.where(medium, smoothed, scaled)
    return inv.float()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [T, heads, d]; cos/sin [T, 1, d]; Hugging Face's half-split rotary layout
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # why fp32: matches the reference's numerics in bf16
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


# why fused: one matmul over the concatenated rows reads the same weights in fewer, larger
# calls; at the default model's shapes (30 layers, AVX-512 EPYC, 2 threads) q, k, v, gate and
# up took 3.30 ms a step as five int4 calls at one row against 2.2 as two, and 16.1 against
# 14.5 ms as bf16 F.linear at 32 rows. Checkpoints keep the separate Hugging Face names;
# fuse_weights concatenates them on load.
FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


def fuse_weights(named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`named` (a state dict) itself, each layer's FUSED parts (weights, biases) replaced by
    their rows joined in order. In place, so each part is freed once joined rather than held
    to the end."""
    for fused, parts in FUSED.items():
        for suffix in (".weight", ".bias"):
            tail = parts[0] + suffix
            for key in [k for k in named if k.endswith(tail)]:
                prefix = key[: -len(tail)]
                names = [prefix + part + suffix for part in parts]
                if all(n in named for n in names):
                    named[prefix + fused + suffix] = torch.cat([named.pop(n) for n in names])
    return named


class Attention(nn.Module):
    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            arch.num_heads,
            arch.num_kv_heads,
            arch.head_dim,
        )
        # q's rows, then k's and v's; a fused layer's parts are split by its module's sizes
        self.sizes = [self.num_heads * self.head_dim] + [self.num_kv_heads * self.head_dim] * 2
        self.qkv_proj = nn.Linear(arch.hidden_size, sum(self.sizes), bias=arch.attention_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, arch.hidden_size, bias=False)

    def forward(self, x, cos, sin, kv: torch.Tensor, meta: AttentionMeta) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.sizes, dim=-1)
        q = rotate(q.view(t, self.num_heads, self.head_dim), cos, sin)
        k = rotate(k.view(t, self.num_kv_heads, self.head_dim), cos, sin)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        o = meta.attend(q, k, v, kv[0], kv[1])
        return self.o_proj(o.reshape(t, -1))


class MLP(nn.Module):
    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        self.sizes = [arch.intermediate_size] * 2  # gate's rows, then up's
        self.gate_up_proj = nn.Linear(arch.hidden_size, sum(self.sizes), bias=False)
        self.down_proj = nn.Linear(arch.intermediate_size, arch.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.sizes, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        self.self_attn = Attention(arch)
        self.mlp = MLP(arch)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)

    def forward(self, x, cos, sin, kv, meta) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(arch) for _ in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)


class LlamaModel(nn.Module):
    """Parameter names follow Hugging Face's, so a state dict loads as is."""

    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        self.arch = arch
        self.model = Backbone(arch)
        self.lm_head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        if arch.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("inv_freq", rope_inv_freq(arch), persistent=False)

    def load(self, weights: dict[str, torch.Tensor]) -> None:
        if self.arch.tie_word_embeddings:  # why again: to_empty() gives each module its own tensor
            self.lm_head.weight = self.model.embed_tokens.weight
        missing, unexpected = self.load_state_dict(fuse_weights(weights), strict=False)
        missing = [
            m for m in missing if not (m == "lm_head.weight" and self.arch.tie_word_embeddings)
        ]
        assert not missing and not unexpected, f"weights mismatch: {missing=} {unexpected=}"

    def rope(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, d/2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [T, 1, d]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] long
        positions: torch.Tensor,  # [T] long
        kv_cache,  # per layer (K, V), each [R, KVH, d]; or a [layers, 2, R, KVH, d] tensor
        meta: AttentionMeta,
        logit_rows: torch.Tensor,  # [B] long: rows whose next-token logits are wanted
        # (layers, x, cos, sin, kv_cache, meta) -> x: the decoder layers run some other way
        run_layers: Callable | None = None,
    ) -> torch.Tensor:  # [B, vocab] float32
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rope(positions, x.dtype)
        if run_layers is not None:
            x = run_layers(self.model.layers, x, cos, sin, kv_cache, meta)
        else:
            for i, layer in enumerate(self.model.layers):
                x = layer(x, cos, sin, kv_cache[i], meta)
        x = self.model.norm(x.index_select(0, logit_rows))
        return self.lm_head(x).float()
