"""The cpu device's paged attention in torch: decodes batched over their gathered contexts (or
gpu_runner/cpu/kernels.py's paged kernel), prompt chunks one by one with SDPA, and the operators
a compiled decode step calls. Layout and contract: gpu_runner/attention.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from gapless.gpu_runner.attention import StepLayout
from gapless.gpu_runner.cpu import kernels

# why: a compiled step specializes a dimension of size 1, so decode contexts span at least two
# pages (the second masked off) and one compilation covers every context length
MIN_DECODE_PAGES = 2


@dataclass
class PrefillSeq:
    """One entry with several query tokens (a prompt chunk)."""

    token_start: int  # first row of this entry in the step's flat token array
    num_tokens: int
    pages: torch.Tensor  # [P] long: KV blocks of the context, in order
    mask: torch.Tensor  # [1, 1, num_tokens, P * bs] bool, True where attending is allowed
    first_pos: int = 0  # position of the first query token
    _windowed: dict[int, torch.Tensor] | None = None  # window -> mask, made once per step

    def window_mask(self, window: int) -> torch.Tensor:
        """mask, less the keys more than `window` - 1 positions before each query."""
        if not window:
            return self.mask
        if self._windowed is None:
            self._windowed = {}
        if window not in self._windowed:
            q_pos = self.first_pos + torch.arange(self.num_tokens)
            keys = torch.arange(self.mask.shape[-1])
            self._windowed[window] = self.mask & (keys[None, :] > q_pos[:, None] - window)
        return self._windowed[window]


@dataclass
class AttnMetadata:
    """The torch path's metadata: decodes batched over gathered contexts, prefills one by one."""

    slot_mapping: torch.Tensor  # [T] long
    decode_rows: torch.Tensor  # [D] long: rows of the flat token array with one query token
    decode_pages: torch.Tensor  # [D, P] long: KV blocks of each decode's context
    decode_ctx: torch.Tensor  # [D] long: context length of each decode, its own token included
    prefills: list[PrefillSeq]
    scale: float
    block_size: int
    all_decode: bool = False  # every row is a decode, in order: no gather or scatter of q
    kernel: bool = False  # decodes take gpu_runner/cpu/kernels.py's paged kernel
    # decode_mask(window) by window, made once per step on the eager path
    _masks: dict[int, torch.Tensor] | None = None

    def decode_mask(self, window: int = 0) -> torch.Tensor:
        """[D, 1, 1, P * bs] bool: False past the context and before the window."""
        if self._masks is None:
            self._masks = {}
        if window not in self._masks:
            self._masks[window] = context_mask(
                self.decode_pages, self.decode_ctx, self.block_size, window
            )
        return self._masks[window]

    def attend(self, q, k, v, k_cache, v_cache, window: int = 0, softcap: float = 0.0):
        if self.all_decode and self.kernel and torch.compiler.is_compiling():
            return torch.ops.gapless.paged_decode(
                q, k, v, k_cache, v_cache, self.slot_mapping, self.decode_pages,
                self.decode_ctx, self.scale, self.block_size, window, softcap,
            )  # fmt: skip
        if self.all_decode and torch.compiler.is_compiling():
            write_kv(k, v, k_cache, v_cache, self.slot_mapping)
            if q.shape[0] == 1:  # the batch-1 graph (sizes of 1 are specialized: no guard)
                # why: one stream's two tiny matmuls in two-thread BLAS calls wait at barriers
                # whenever the frontend or detokenizer takes a core; served, one stream decoded
                # slower with them than with this generated kernel (bench/RESULTS.md, "cpu:
                # threads, attention and the compiled step before the kernels")
                return fused_decode(q, k_cache, v_cache, self, window, softcap)
            return decode_attention(
                q, k_cache, v_cache, self.decode_pages, self.decode_ctx, self.scale,
                self.block_size, window, softcap,
            )  # fmt: skip
        return paged_attention(q, k, v, k_cache, v_cache, self, window, softcap)


class TorchAttention:
    """Builds AttnMetadata on the cpu; decode page tables live in a static buffer.

    why context lengths and not a mask: the [D, P * bs] mask cost more host time than the rest
    of a step's preparation (bench/RESULTS.md, "host floor: each stage at batch 256, and the
    floor"); attention derives it where it is used, fused into the compiled step."""

    def __init__(
        self, max_decodes: int, max_context: int, block_size: int, scale: float, kernel: bool
    ) -> None:
        self.scale = scale
        self.block_size = block_size
        self.kernel = kernel
        max_pages = max(MIN_DECODE_PAGES, -(-max_context // block_size))
        self._pages = np.zeros(max_decodes * max_pages, dtype=np.int64)
        self._rows = torch.arange(max_decodes)  # [max_decodes] long: decode_rows of a decode step

    def build(self, layout: StepLayout, slot_mapping: torch.Tensor) -> AttnMetadata:
        bs = layout.block_size
        n = layout.num_tokens
        if layout.is_decode:  # every entry one token, in row order
            return self._decodes(layout, slot_mapping, np.arange(len(n)), self._rows[: len(n)])
        ends = np.cumsum(n)
        single = np.flatnonzero(n == 1)
        meta = self._decodes(layout, slot_mapping, single, torch.from_numpy(ends[single] - 1))
        for j in np.flatnonzero(n > 1):  # per prompt chunk: its own causal mask over the prefix
            p = int(layout.num_pages[j])
            q_pos = layout.ctx_len[j] - n[j] + np.arange(n[j])
            mask = np.arange(p * bs)[None, :] <= q_pos[:, None]  # [n, P * bs]
            meta.prefills.append(
                PrefillSeq(
                    token_start=int(ends[j] - n[j]),
                    num_tokens=int(n[j]),
                    pages=torch.from_numpy(layout.page_table[j, :p].copy()),
                    mask=torch.from_numpy(mask)[None, None],
                    first_pos=int(q_pos[0]),
                )
            )
        return meta

    def _decodes(
        self, layout: StepLayout, slot_mapping: torch.Tensor, single: np.ndarray, rows
    ) -> AttnMetadata:
        """Metadata of the entries `single` ([D] int64, one query token each, at `rows`)."""
        d, bs = len(single), layout.block_size
        all_decode = d == len(layout.num_tokens)
        ctx = layout.ctx_len if all_decode else layout.ctx_len[single]  # [D]
        p = max(MIN_DECODE_PAGES, -(-int(ctx.max(initial=0)) // bs))
        pages = self._pages[: d * p].reshape(d, p)
        have = min(p, layout.page_table.shape[1])
        pages[:, :have] = (
            layout.page_table[:d, :have] if all_decode else layout.page_table[single, :have]
        )
        pages[:, have:] = 0  # past every context: masked off
        return AttnMetadata(
            slot_mapping=slot_mapping,
            decode_rows=rows,
            decode_pages=torch.from_numpy(pages),
            decode_ctx=torch.from_numpy(ctx),
            prefills=[],
            scale=self.scale,
            block_size=bs,
            all_decode=all_decode,
            kernel=self.kernel,
        )


def context_mask(
    pages: torch.Tensor, ctx: torch.Tensor, block_size: int, window: int = 0
) -> torch.Tensor:
    """[D, 1, 1, P * bs] bool: True at the key positions below each decode's context length
    (and, with a window, at the last `window` of them)."""
    keys = torch.arange(pages.shape[1] * block_size, device=pages.device)
    seen = keys < ctx[:, None]
    if window:
        seen = seen & (keys >= ctx[:, None] - window)
    return seen[:, None, None, :]


def attention(q, k, v, mask, scale: float, softcap: float = 0.0) -> torch.Tensor:
    """SDPA over q [..., Lq, d] and k, v [..., L, d] (the same heads), mask bool; with
    soft-capped scores where softcap > 0, which SDPA cannot do (then in float32)."""
    if not softcap:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    s = (q.float() @ k.float().transpose(-1, -2)) * scale
    s = (torch.tanh(s / softcap) * softcap).masked_fill(~mask, float("-inf"))
    return (s.softmax(-1) @ v.float()).to(q.dtype)


def paged_attention(
    q: torch.Tensor,  # [T, H, d]
    k: torch.Tensor,  # [T, KVH, d]
    v: torch.Tensor,  # [T, KVH, d]
    k_cache: torch.Tensor,  # [R, KVH, d], R = num_blocks * block_size
    v_cache: torch.Tensor,
    meta: AttnMetadata,
    window: int = 0,  # keys a query sees, its own included; 0: all
    softcap: float = 0.0,
) -> torch.Tensor:  # [T, H, d]
    if meta.all_decode and meta.kernel:
        return kernels.paged_decode(
            q, k_cache, v_cache, meta.decode_pages, meta.decode_ctx, meta.scale,
            meta.block_size, writes=(k, v, meta.slot_mapping), window=window, softcap=softcap,
        )  # fmt: skip
    k_cache.index_copy_(0, meta.slot_mapping, k)
    v_cache.index_copy_(0, meta.slot_mapping, v)
    if meta.all_decode:
        return _decode(q.unsqueeze(2), k_cache, v_cache, meta, window, softcap).squeeze(2)
    out = torch.empty_like(q)
    if meta.decode_rows.numel():
        qd = q.index_select(0, meta.decode_rows)  # [D, H, d]
        if meta.kernel:
            od = kernels.paged_decode(
                qd, k_cache, v_cache, meta.decode_pages, meta.decode_ctx, meta.scale,
                meta.block_size, window=window, softcap=softcap,
            )  # fmt: skip
        else:
            od = _decode(qd.unsqueeze(2), k_cache, v_cache, meta, window, softcap).squeeze(2)
        out.index_copy_(0, meta.decode_rows, od)
    paged = (-1, meta.block_size, *k_cache.shape[1:])  # [blocks, bs, KVH, d]
    for p in meta.prefills:
        rows = slice(p.token_start, p.token_start + p.num_tokens)
        qp = q[rows].transpose(0, 1).unsqueeze(0)  # [1, H, n, d]
        kp = _gather(k_cache, paged, p.pages).flatten(0, 1).transpose(0, 1).unsqueeze(0)
        vp = _gather(v_cache, paged, p.pages).flatten(0, 1).transpose(0, 1).unsqueeze(0)
        mask = p.window_mask(window)
        if softcap:
            group = q.shape[1] // k_cache.shape[1]  # query heads per KV head
            kp, vp = kp.repeat_interleave(group, 1), vp.repeat_interleave(group, 1)
            op = attention(qp, kp, vp, mask, meta.scale, softcap)
        else:
            op = F.scaled_dot_product_attention(
                qp, kp, vp, attn_mask=mask, scale=meta.scale, enable_gqa=True
            )
        out[rows] = op.squeeze(0).transpose(0, 1)
    return out


@torch.library.custom_op("gapless::write_kv", mutates_args=("k_cache", "v_cache"))
def write_kv(
    k: torch.Tensor,  # [T, KVH, d]
    v: torch.Tensor,
    k_cache: torch.Tensor,  # [R, KVH, d]: a whole tensor, never a view (see below)
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] long
) -> None:
    """The cache writes of a compiled step, in place.

    why an operator: traced as plain index_copy_, a mutated graph input would be copied whole
    per layer; and the compiler loses writes into views of a graph input once shapes are
    dynamic (as of torch 2.13), hence one tensor per layer for K and for V."""
    k_cache.index_copy_(0, slot_mapping, k)
    v_cache.index_copy_(0, slot_mapping, v)


@write_kv.register_fake
def _(k, v, k_cache, v_cache, slot_mapping) -> None:
    return None


def fused_decode(
    q: torch.Tensor,  # [D, H, d]
    k_cache: torch.Tensor,  # [R, KVH, d]
    v_cache: torch.Tensor,
    meta: AttnMetadata,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:  # [D, H, d]
    """Decode attention written for the compiler: the block gather is indexing that it folds
    into the two reductions, so K and V are read from the cache once and never copied; scores
    and softmax in float32. Eagerly this is slower than _decode; compiled, faster."""
    d_, p_ = meta.decode_pages.shape
    bs, kvh, hd = meta.block_size, k_cache.shape[1], k_cache.shape[2]
    offs = torch.arange(bs, device=q.device)
    rows = (meta.decode_pages[:, :, None] * bs + offs).reshape(d_, p_ * bs)  # [D, L]
    k = k_cache[rows].permute(0, 2, 3, 1).float()  # [D, KVH, d, L]
    v = v_cache[rows].permute(0, 2, 1, 3).float()  # [D, KVH, L, d]
    qg = q.reshape(d_, kvh, -1, hd).float()  # [D, KVH, G, d]: G query heads per KV head
    s = (qg[..., None] * k[:, :, None]).sum(-2) * meta.scale  # [D, KVH, G, L]
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    mask = context_mask(meta.decode_pages, meta.decode_ctx, bs, window)
    s = s.masked_fill(~mask, float("-inf"))
    o = (s.softmax(-1)[..., None] * v[:, :, None]).sum(-2)  # [D, KVH, G, d]
    return o.reshape(q.shape).to(q.dtype)


@torch.library.custom_op("gapless::decode_attention", mutates_args=())
def decode_attention(
    q: torch.Tensor,  # [D, H, d]
    k_cache: torch.Tensor,  # [R, KVH, d]
    v_cache: torch.Tensor,
    pages: torch.Tensor,  # [D, P] long
    ctx: torch.Tensor,  # [D] long: context lengths
    scale: float,
    block_size: int,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:  # [D, H, d]
    """Decode attention of a compiled step, kept whole as one operator.

    why an operator: traced, the compiler turns the attention's two batched matmuls over
    dynamic shapes into its own loops, tens of times slower than the BLAS calls (as of torch
    2.13); written as indexing and reductions for it to fuse, the kernel it made took half of
    a batch-32 step on top of the matmuls. Here the blocks are gathered once per cache and the
    query heads sharing a KV head are that head's query rows ([D, KVH, G, d]), so K and V are
    read once per KV head. why SDPA rather than two matmuls: it is the faster per layer at
    batch-32 decodes (bench/RESULTS.md: "cpu: threads, attention and the compiled step before
    the kernels", "cpu on the AVX2-only EPYC")."""
    d_ = pages.shape[0]
    kvh, hd = k_cache.shape[1], k_cache.shape[2]
    paged = (-1, block_size, kvh, hd)
    k = _gather(k_cache, paged, pages).view(d_, -1, kvh, hd).transpose(1, 2)  # [D, KVH, L, d]
    v = _gather(v_cache, paged, pages).view(d_, -1, kvh, hd).transpose(1, 2)
    qg = q.reshape(d_, kvh, -1, hd)  # [D, KVH, G, d]
    mask = context_mask(pages, ctx, block_size, window)
    return attention(qg, k, v, mask, scale, softcap).reshape(q.shape)


@decode_attention.register_fake
def _(q, k_cache, v_cache, pages, ctx, scale, block_size, window=0, softcap=0.0) -> torch.Tensor:
    return torch.empty_like(q)


def _decode(
    qd: torch.Tensor, k_cache, v_cache, meta: AttnMetadata, window: int = 0, softcap: float = 0.0
) -> torch.Tensor:
    # qd [D, H, 1, d] -> [D, H, 1, d]; contexts gathered a block at a time
    paged = (-1, meta.block_size, *k_cache.shape[1:])  # [blocks, bs, KVH, d]
    kd = _gather(k_cache, paged, meta.decode_pages).flatten(1, 2).transpose(1, 2)  # [D, KVH, L, d]
    vd = _gather(v_cache, paged, meta.decode_pages).flatten(1, 2).transpose(1, 2)
    # why grouped: the H / KVH query heads that share a KV head become that head's query rows
    # ([D, KVH, G, d]; head h reads KV head h // G, as repeat_interleave has it), so SDPA reads
    # each context once instead of enable_gqa's copy of K and V per query head, several times
    # less time per layer
    d, h, kvh = qd.shape[0], qd.shape[1], kd.shape[1]
    qg = qd.reshape(d, kvh, h // kvh, qd.shape[-1])
    out = attention(qg, kd, vd, meta.decode_mask(window), meta.scale, softcap)  # [D, KVH, G, d]
    return out.reshape(qd.shape)


def _gather(cache: torch.Tensor, paged: tuple, pages: torch.Tensor) -> torch.Tensor:
    """cache viewed as [blocks, bs, KVH, d], the blocks of `pages` ([...] long) -> [..., bs, KVH, d].

    why index_select: on cpu it copies whole blocks several times faster than advanced indexing
    """
    blocks = cache.view(paged)
    return torch.index_select(blocks, 0, pages.reshape(-1)).view(*pages.shape, *blocks.shape[1:])
