"""Paged attention in plain torch, and the per-step metadata it reads.

The KV cache of one layer is a flat array of token rows: [num_blocks * block_size, kv_heads,
head_dim]. A token at position p of a slot lives at row block_table[slot, p // bs] * bs + p % bs.
Block 0 is never handed to a request; padded entries point at it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PrefillSeq:
    """One entry with several query tokens (a prompt chunk)."""

    token_start: int  # first row of this entry in the step's flat token array
    num_tokens: int
    kv_rows: torch.Tensor  # [ctx] long: cache rows of positions 0..ctx-1
    mask: torch.Tensor  # [1, 1, num_tokens, ctx] bool, True where attending is allowed


@dataclass
class AttnMetadata:
    """Built once per step, shared by every layer."""

    slot_mapping: torch.Tensor  # [T] long: cache row written by each query token
    decode_rows: (
        torch.Tensor
    )  # [D] long: rows of the flat token array that are single-token entries
    decode_kv_rows: torch.Tensor  # [D, L] long: cache rows of each decode's context, padded with 0
    decode_mask: torch.Tensor  # [D, 1, 1, L] bool, False on padding
    prefills: list[PrefillSeq]


def paged_attention(
    q: torch.Tensor,  # [T, H, d]
    k: torch.Tensor,  # [T, KVH, d]
    v: torch.Tensor,  # [T, KVH, d]
    k_cache: torch.Tensor,  # [R, KVH, d], R = num_blocks * block_size
    v_cache: torch.Tensor,
    meta: AttnMetadata,
    scale: float,
) -> torch.Tensor:  # [T, H, d]
    k_cache.index_copy_(0, meta.slot_mapping, k)
    v_cache.index_copy_(0, meta.slot_mapping, v)
    out = torch.empty_like(q)
    if meta.decode_rows.numel():
        qd = q.index_select(0, meta.decode_rows).unsqueeze(2)  # [D, H, 1, d]
        kd = k_cache[meta.decode_kv_rows].transpose(1, 2)  # [D, KVH, L, d]
        vd = v_cache[meta.decode_kv_rows].transpose(1, 2)
        od = F.scaled_dot_product_attention(
            qd, kd, vd, attn_mask=meta.decode_mask, scale=scale, enable_gqa=True
        )
        out.index_copy_(0, meta.decode_rows, od.squeeze(2))
    for p in meta.prefills:
        rows = slice(p.token_start, p.token_start + p.num_tokens)
        qp = q[rows].transpose(0, 1).unsqueeze(0)  # [1, H, n, d]
        kp = k_cache[p.kv_rows].transpose(0, 1).unsqueeze(0)  # [1, KVH, ctx, d]
        vp = v_cache[p.kv_rows].transpose(0, 1).unsqueeze(0)
        op = F.scaled_dot_product_attention(
            qp, kp, vp, attn_mask=p.mask, scale=scale, enable_gqa=True
        )
        out[rows] = op.squeeze(0).transpose(0, 1)
    return out
