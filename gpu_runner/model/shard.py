"""One rank's share of a model under tensor parallelism (common/shards.py says who holds what).

q/k/v and gate/up are split by output rows (whole heads, K/V heads replicated where there are
fewer than ranks), o and down by input columns (their outputs are partial sums the decoder
all-reduces), the embedding and the output layer by vocabulary rows. Norms, routers and RoPE
are replicated. A bias added after an all-reduce is kept by rank 0 only (zeros elsewhere), so
the sum counts it once.
"""

from __future__ import annotations

import msgspec
import torch

from gapless.common.families.base import ModelArch
from gapless.common.shards import even_range, kv_head_range, q_head_range, vocab_range

_VOCAB = ("model.embed_tokens.weight", "lm_head.weight")
_ROWS = ("gate_proj", "up_proj")  # split by output rows, evenly
_COLUMNS = ("down_proj",)  # split by input columns, evenly


def local_arch(arch: ModelArch, rank: int, size: int) -> ModelArch:
    """The shapes rank builds its layers with; the vocabulary stays whole (the model's own
    embedding and output layer hold its share of rows, see vocab_range)."""
    q = q_head_range(arch.num_heads, arch.num_kv_heads, size, rank)
    kv = kv_head_range(arch.num_kv_heads, size, rank)

    def share(n: int) -> int:
        start, end = even_range(n, size, rank)
        return end - start

    return msgspec.structs.replace(
        arch,
        num_heads=q[1] - q[0],
        num_kv_heads=kv[1] - kv[0],
        intermediate_size=share(arch.intermediate_size),
        moe_intermediate_size=share(arch.moe_intermediate_size),
        shared_expert_intermediate_size=share(arch.shared_expert_intermediate_size),
    )


def _module(name: str) -> str:
    """The layer a parameter belongs to: q_proj of ...q_proj.weight; stacked experts' tensors
    (mlp.experts.gate_proj) carry no suffix."""
    parts = name.split(".")
    return parts[-2] if parts[-1] in ("weight", "bias") else parts[-1]


def _even(w: torch.Tensor, dim: int, rank: int, size: int) -> torch.Tensor:
    start, end = even_range(w.shape[dim], size, rank)
    return w.narrow(dim, start, end - start)


def _heads(w: torch.Tensor, dim: int, heads: tuple[int, int], head_dim: int) -> torch.Tensor:
    return w.narrow(dim, heads[0] * head_dim, (heads[1] - heads[0]) * head_dim)


def _vocab(w: torch.Tensor, arch: ModelArch, rank: int, size: int) -> torch.Tensor:
    """Rows of rank's vocabulary chunk, padded with zeros to the chunk's full length."""
    start, end = vocab_range(arch.vocab_size, size, rank)
    chunk = -(-arch.vocab_size // size)
    out = w.new_zeros((chunk, *w.shape[1:]))
    out[: end - start] = w[start:end]
    return out


class Sharder:
    """Cuts full tensors (Hugging Face names, q/k not interleaved) to rank's share."""

    def __init__(self, arch: ModelArch, rank: int, size: int) -> None:
        self.arch, self.rank, self.size = arch, rank, size
        h, k = arch.num_heads, arch.num_kv_heads
        self.q = q_head_range(h, k, size, rank)
        self.kv = kv_head_range(k, size, rank)

    def __call__(self, name: str, w: torch.Tensor) -> torch.Tensor:
        a, r, n = self.arch, self.rank, self.size
        if name in _VOCAB:
            return _vocab(w, a, r, n)
        module, bias = _module(name), name.endswith(".bias")
        if module == "q_proj":
            return _heads(w, 0, self.q, a.head_dim)
        if module in ("k_proj", "v_proj"):
            return _heads(w, 0, self.kv, a.head_dim)
        if module == "qkv_proj":  # joined in the checkpoint (Phi-3): each part cut, rejoined
            sizes = [a.num_heads * a.head_dim] + [a.num_kv_heads * a.head_dim] * 2
            q, k, v = w.split(sizes, dim=0)
            parts = ((q, self.q), (k, self.kv), (v, self.kv))
            return torch.cat([_heads(p, 0, heads, a.head_dim) for p, heads in parts])
        if module == "o_proj" and bias:
            return w if r == 0 else torch.zeros_like(w)
        if module == "o_proj":
            return _heads(w, 1, self.q, a.head_dim)
        if module in _ROWS:
            return _even(w, -2 if w.dim() > 1 else 0, r, n)
        if module == "gate_up_proj":  # joined gate and up rows: each half cut, rejoined
            gate, up = w.chunk(2, dim=-2)
            return torch.cat([_even(gate, -2, r, n), _even(up, -2, r, n)], dim=-2)
        if module in _COLUMNS:
            return _even(w, -1, r, n)
        return w

    def shard(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`weights` cut in place, each full tensor dropped once its share is copied out."""
        for name in list(weights):
            w = self(name, weights.pop(name)).contiguous()
            weights[name] = w.clone() if w._base is not None else w
        return weights
