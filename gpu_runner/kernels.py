"""The cpu device's hand-written kernel: paged decode attention (paged_decode.cpp).

It is built with the machine's C++ compiler the first time a runner asks for it (well under a
second) and kept under `<cache dir>/kernels`, keyed by its source, flags and the CPU's
features. It joins torch's OpenMP runtime rather than starting a second thread team. Where
it cannot be built (no compiler), or for a storage type it lacks, attention takes torch's path.

why a kernel of our own: torch's path gathers each decode's K and V blocks into a dense copy,
then runs SDPA over it; in the compiled batch-32 step of the default model (w8a8, AVX2 EPYC,
2 cores, ~150-token contexts) that was 79 of 210 ms under torch's profiler (SDPA 45, the
gather 25, the op around them 9). This kernel reads each cached row once, in place, a
sequence per task: `make bench`'s test_bench_decode_attention_of_a_step (30 layers' caches,
32 decodes of 130-170 tokens) took 31.3 ms against torch's 160.5, and the whole decode step
(`python -m gapless.bench.cpu_step --batch 32 --steps 32 --runs 2 [-- --no-attention-kernel]`,
alternating twice) 134 / 121 ms against 197 / 183. A task per (sequence, KV head) instead,
which reads a third of each row, took twice as long on cold caches (1.95 against 0.99 ms a
layer at 32 decodes of <= 192 tokens). On a CPU with AVX-512 BF16, bfloat16 caches take the
source's vector path (its header has the measurements: 3.7 against 17.7 ms in bfloat16).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
from pathlib import Path

import torch

from gapless.core.common.model_cache import cache_dir

log = logging.getLogger("gapless.gpu_runner")

SOURCE = Path(__file__).with_name("paged_decode.cpp")
FLAGS = ["-O3", "-march=native", "-std=c++17", "-fPIC", "-fopenmp"]
DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}
_ARGS = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 4 + [ctypes.c_void_p] * 5
_ARGS += [ctypes.c_int64] * 6 + [ctypes.c_float, ctypes.c_int]


def _cpu_features() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    return next((line for line in text.splitlines() if line.startswith("flags")), "")


def _openmp_runtime() -> str | None:
    """The OpenMP library torch loaded (its own copy, often renamed), to link against."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    paths = {line.split()[-1] for line in maps.splitlines() if line.count(" ") >= 5}
    return next((p for p in sorted(paths) if "gomp" in Path(p).name), None) or next(
        (p for p in sorted(paths) if "iomp" in Path(p).name), None
    )


def _build(out: Path) -> None:
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise RuntimeError("no C++ compiler (set CXX or install g++)")
    runtime = _openmp_runtime()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    obj = tmp.with_suffix(".o")
    # why compile and link apart: `-fopenmp` at link time names the system's libgomp, a second
    # runtime beside the one torch loaded, whose threads would fight torch's for the cores
    link = [runtime] if runtime else ["-fopenmp"]
    try:
        subprocess.run([compiler, *FLAGS, "-c", str(SOURCE), "-o", str(obj)],
                       check=True, capture_output=True, text=True)  # fmt: skip
        subprocess.run([compiler, "-shared", str(obj), *link, "-o", str(tmp)],
                       check=True, capture_output=True, text=True)  # fmt: skip
        os.replace(tmp, out)  # why: runners that start together each build, one file wins
    except subprocess.CalledProcessError as e:
        raise RuntimeError(f"{' '.join(map(str, e.cmd))} failed:\n{e.stderr}") from e
    finally:
        obj.unlink(missing_ok=True)
        tmp.unlink(missing_ok=True)


@functools.cache
def library() -> ctypes.CDLL | None:
    """The built kernel, or None (logged once) where it cannot be built."""
    key = hashlib.sha256(
        SOURCE.read_bytes() + " ".join(FLAGS).encode() + _cpu_features().encode()
    ).hexdigest()[:16]
    path = cache_dir() / "kernels" / f"paged_decode-{key}.so"
    try:
        if not path.exists():
            _build(path)
        lib = ctypes.CDLL(str(path))
    except (OSError, RuntimeError) as e:
        log.warning("cpu attention kernel unavailable, using torch's: %s", e)
        return None
    for name in DTYPES.values():
        fn = getattr(lib, f"paged_decode_{name}")
        fn.argtypes, fn.restype = _ARGS, None
    return lib


def available(dtype: torch.dtype) -> bool:
    return dtype in DTYPES and library() is not None


def _rows_contiguous(t: torch.Tensor) -> bool:
    """Whether each row of t [W, KVH, d] is KVH * d contiguous elements."""
    return t.stride(2) == 1 and (t.shape[1] == 1 or t.stride(1) == t.shape[2])


def paged_decode(
    q: torch.Tensor,  # [D, H, d]
    k_cache: torch.Tensor,  # [R, KVH, d]
    v_cache: torch.Tensor,
    pages: torch.Tensor,  # [D, P] long
    ctx: torch.Tensor,  # [D] long, each in 1..P * block_size
    scale: float,
    block_size: int,
    writes: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:  # [D, H, d]
    """Decode attention over the paged cache; `writes` (k, v [W, KVH, d], slots [W] long) go
    into the cache first. Needs available(q.dtype)."""
    lib = library()
    assert lib is not None and q.dtype in DTYPES, "the kernel is built for this dtype"
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.dtype == q.dtype
    d_, h, hd = q.shape
    kvh = k_cache.shape[1]
    q, pages, ctx = q.contiguous(), pages.contiguous(), ctx.contiguous()
    out = torch.empty_like(q)
    if writes is None:
        k = v = slots = None
        num_writes = 0
        steps = (0, 0, 0)
    else:
        # why strides rather than .contiguous(): the compiled layer's v is a view of the fused
        # qkv output and its slots a column of the step's table; each copy was a call a layer
        k, v = (t if _rows_contiguous(t) else t.contiguous() for t in writes[:2])
        slots = writes[2]
        num_writes = slots.shape[0]
        assert k.dtype == v.dtype == q.dtype and k.shape == v.shape == (num_writes, kvh, hd)
        assert slots.dtype == torch.int64 and slots.dim() == 1
        steps = (k.stride(0), v.stride(0), slots.stride(0))
    getattr(lib, f"paged_decode_{DTYPES[q.dtype]}")(
        q.data_ptr(),
        None if k is None else k.data_ptr(),
        None if v is None else v.data_ptr(),
        None if slots is None else slots.data_ptr(),
        num_writes,
        *steps,
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        pages.data_ptr(),
        ctx.data_ptr(),
        out.data_ptr(),
        d_,
        pages.shape[1],
        kvh,
        h // kvh,
        hd,
        block_size,
        scale,
        torch.get_num_threads(),
    )
    return out
