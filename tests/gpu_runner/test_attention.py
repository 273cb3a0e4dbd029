"""The cpu device's paged decode attention against dense attention over each context."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gapless.gpu_runner.cpu import kernels
from gapless.gpu_runner.cpu.attention import AttnMetadata, _decode, decode_attention, fused_decode

BS = 16


def _case(num: int, heads: int, kv_heads: int, dtype: torch.dtype, seed: int, hd=64, bs=BS):
    g = torch.Generator().manual_seed(seed)
    pages_each = 5
    ctx = torch.randint(1, pages_each * bs + 1, (num,), generator=g)
    blocks = 1 + num * pages_each
    k_cache = torch.randn(blocks * bs, kv_heads, hd, generator=g).to(dtype)
    v_cache = torch.randn(blocks * bs, kv_heads, hd, generator=g).to(dtype)
    pages = (torch.randperm(blocks - 1, generator=g)[: num * pages_each] + 1).view(num, -1)
    q = torch.randn(num, heads, hd, generator=g).to(dtype)
    return q, k_cache, v_cache, pages, ctx, hd**-0.5


def _dense(q, k_cache, v_cache, pages, ctx, scale, bs=BS, window=0, softcap=0.0):
    """Each decode's attention over its last `window` keys (0: all), scores soft-capped."""
    out = []
    for i in range(q.shape[0]):
        rows = (pages[i, :, None] * bs + torch.arange(bs)).reshape(-1)[: int(ctx[i])]
        rows = rows[-window:] if window else rows
        k = k_cache[rows].transpose(0, 1).float()  # [KVH, n, d]
        v = v_cache[rows].transpose(0, 1).float()
        qi = q[i].float()[:, None]  # [H, 1, d]
        if softcap:
            group = q.shape[1] // k.shape[0]
            k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
            s = torch.tanh(qi @ k.transpose(1, 2) * scale / softcap) * softcap
            out.append((s.softmax(-1) @ v)[:, 0])
            continue
        out.append(F.scaled_dot_product_attention(qi, k, v, scale=scale, enable_gqa=True)[:, 0])
    return torch.stack(out)


@pytest.fixture(scope="module", autouse=True)
def _kernel_built():
    """The paged kernel builds wherever the suite runs (the compiled step needs a C++ compiler
    too); only a machine without one would run attention through torch."""
    assert kernels.library() is not None, "the paged decode kernel did not build"


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
        "kernel": kernels.paged_decode(q, k_cache, v_cache, pages, ctx, scale, BS),
    }
    for name, out in got.items():
        assert out.dtype == dtype and out.shape == q.shape, name
        torch.testing.assert_close(out.float(), want, atol=tol, rtol=tol, msg=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("window", "softcap"), [(5, 0.0), (23, 0.0), (0, 2.0), (17, 3.0)])
def test_every_decode_path_takes_a_window_and_a_soft_cap(dtype, window, softcap):
    """Contexts up to five blocks against windows shorter than one block, longer than one,
    with and without soft-capped scores: each path sees only the window's keys."""
    q, k_cache, v_cache, pages, ctx, scale = _case(7, 8, 2, dtype, seed=window, hd=64)
    ctx[0], ctx[1] = window or 3, max(1, window - 1)  # contexts no longer than the window
    q = q * 4  # why: scores of several units, so the cap bends them
    want = _dense(q, k_cache, v_cache, pages, ctx, scale, window=window, softcap=softcap)
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
    args = (q, k_cache, v_cache, pages, ctx, scale, BS)
    got = {
        "decode_attention": decode_attention(*args, window, softcap),
        "eager": _decode(q.unsqueeze(2), k_cache, v_cache, meta, window, softcap).squeeze(2),
        "fused": fused_decode(q, k_cache, v_cache, meta, window, softcap),
        "kernel": kernels.paged_decode(*args, window=window, softcap=softcap),
    }
    unwindowed = _dense(q, k_cache, v_cache, pages, ctx, scale)
    assert not torch.allclose(want, unwindowed, atol=1e-2), "the case would not show a wrong mask"
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for name, out in got.items():
        torch.testing.assert_close(out.float(), want, atol=tol, rtol=tol, msg=name)


@pytest.mark.parametrize(("hd", "bs"), [(128, 16), (64, 40), (64, 8), (96, 16)])
def test_the_kernel_over_head_and_block_sizes(hd, bs):
    """bfloat16 over the head sizes with a vector path on AVX-512 (64, 128) and one without
    (96), with blocks of more than sixteen tokens, not a multiple of sixteen, and fewer."""
    q, k_cache, v_cache, pages, ctx, scale = _case(
        9, 8, 2, torch.bfloat16, seed=hd + bs, hd=hd, bs=bs
    )
    want = _dense(q, k_cache, v_cache, pages, ctx, scale, bs)
    got = kernels.paged_decode(q, k_cache, v_cache, pages, ctx, scale, bs)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("where", ["first", "last"])
def test_a_nan_in_the_cache_reaches_the_output_as_in_torch(dtype, where):
    """A NaN key makes its KV head's outputs NaN, as dense attention's are, wherever in the
    context it is (a NaN must not turn into plausible numbers on any path)."""
    q, k_cache, v_cache, pages, ctx, scale = _case(4, 9, 3, dtype, seed=5)
    ctx[:] = 40
    t = 0 if where == "first" else 39
    k_cache[pages[1, t // BS] * BS + t % BS, 2, 7] = float("nan")
    want = _dense(q, k_cache, v_cache, pages, ctx, scale)
    got = kernels.paged_decode(q, k_cache, v_cache, pages, ctx, scale, BS).float()
    assert torch.isnan(want[1, 6:]).all() and not torch.isnan(want[[0, 2, 3]]).any()
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.nan_to_num(), want.nan_to_num(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_writes_the_step_s_rows_before_attending(dtype):
    q, k_cache, v_cache, pages, ctx, scale = _case(5, 9, 3, dtype, seed=11)
    g = torch.Generator().manual_seed(12)
    k = torch.randn(5, 3, 64, generator=g).to(dtype)
    v = torch.randn(5, 5, 64, generator=g).to(dtype)[:, 1:4]  # a view, as of a fused output
    # each decode's own token: the last position of its context; a column, as of the table
    last = ctx - 1
    table = torch.zeros(5, 3, dtype=torch.long)
    table[:, 1] = pages.gather(1, (last // BS)[:, None])[:, 0] * BS + last % BS
    slots = table[:, 1]
    assert not v.is_contiguous() and not slots.is_contiguous()
    want_k, want_v = k_cache.clone(), v_cache.clone()
    want_k[slots], want_v[slots] = k, v
    want = _dense(q, want_k, want_v, pages, ctx, scale)

    got = kernels.paged_decode(q, k_cache, v_cache, pages, ctx, scale, BS, writes=(k, v, slots))
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


def test_without_a_compiler_attention_stays_on_torch(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("GAPLESS_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(kernels, "_loaded", None)  # as a process that has not loaded it yet
    kernels.library.cache_clear()
    try:
        assert not kernels.available(torch.float32)
        assert "cpu attention kernel unavailable" in caplog.text
        assert not list(tmp_path.rglob("*.so"))
    finally:
        kernels.library.cache_clear()  # the next caller builds (or finds) the real one


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("path", ["torch", "kernel"])
def test_bench_decode_attention_of_a_step(benchmark, path, dtype):
    """One batch-32 step's decode attention over the default model's 30 layers (3 KV heads of
    64, ~150-token contexts in scattered blocks), each layer its own cache as in the runner, so
    K and V come from memory rather than from the last call's cache lines; `make bench` times
    torch's gather + SDPA against the paged kernel, in float32 and in bfloat16 (where the
    kernel has its AVX-512 path)."""
    g = torch.Generator().manual_seed(3)
    num, pages_each, blocks = 32, 12, 1024
    caches = [
        tuple(torch.randn(blocks * BS, 3, 64, generator=g).to(dtype) for _ in "kv")
        for _ in range(30)
    ]
    pages = (torch.randperm(blocks - 1, generator=g)[: num * pages_each] + 1).view(num, -1)
    ctx = torch.randint(130, 170, (num,), generator=g)
    q = torch.randn(num, 9, 64, generator=g).to(dtype)

    def step():
        for k_cache, v_cache in caches:
            if path == "kernel":
                kernels.paged_decode(q, k_cache, v_cache, pages, ctx, 0.125, BS)
            else:
                decode_attention(q, k_cache, v_cache, pages, ctx, 0.125, BS)

    benchmark(step)
    want = decode_attention(q, *caches[0], pages, ctx, 0.125, BS)
    got = kernels.paged_decode(q, *caches[0], pages, ctx, 0.125, BS)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
