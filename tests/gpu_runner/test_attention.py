"""The cpu device's paged decode attention against dense attention over each context."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gapless.gpu_runner.attention import AttnMetadata, _decode, decode_attention, fused_decode

BS = 16


def _case(num: int, heads: int, kv_heads: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    hd, pages_each = 64, 5
    ctx = torch.randint(1, pages_each * BS + 1, (num,), generator=g)
    blocks = 1 + num * pages_each
    k_cache = torch.randn(blocks * BS, kv_heads, hd, generator=g).to(dtype)
    v_cache = torch.randn(blocks * BS, kv_heads, hd, generator=g).to(dtype)
    pages = (torch.randperm(blocks - 1, generator=g)[: num * pages_each] + 1).view(num, -1)
    q = torch.randn(num, heads, hd, generator=g).to(dtype)
    return q, k_cache, v_cache, pages, ctx, hd**-0.5


def _dense(q, k_cache, v_cache, pages, ctx, scale) -> torch.Tensor:
    out = []
    for i in range(q.shape[0]):
        rows = (pages[i, :, None] * BS + torch.arange(BS)).reshape(-1)[: int(ctx[i])]
        k = k_cache[rows].transpose(0, 1).float()  # [KVH, n, d]
        v = v_cache[rows].transpose(0, 1).float()
        qi = q[i].float()[:, None]  # [H, 1, d]
        out.append(F.scaled_dot_product_attention(qi, k, v, scale=scale, enable_gqa=True)[:, 0])
    return torch.stack(out)


@pytest.mark.parametrize(("heads", "kv_heads"), [(9, 3), (4, 4), (8, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_equals_dense_attention(heads, kv_heads, dtype):
    q, k_cache, v_cache, pages, ctx, scale = _case(7, heads, kv_heads, dtype, seed=heads)
    want = _dense(q, k_cache, v_cache, pages, ctx, scale)
    meta = AttnMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.long),
        decode_rows=torch.arange(7),
        decode_pages=pages,
        decode_ctx=ctx,
        prefills=[],
        scale=scale,
        block_size=BS,
        all_decode=True,
    )
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    got = {
        "decode_attention": decode_attention(q, k_cache, v_cache, pages, ctx, scale, BS),
        "eager": _decode(q.unsqueeze(2), k_cache, v_cache, meta).squeeze(2),
        "fused": fused_decode(q, k_cache, v_cache, meta),
    }
    for name, out in got.items():
        assert out.dtype == dtype and out.shape == q.shape, name
        torch.testing.assert_close(out.float(), want, atol=tol, rtol=tol, msg=name)
