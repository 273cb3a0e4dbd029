"""The cpu device's hand-written kernels, torch operators: paged decode attention
(paged_decode.cpp, gapless::paged_decode) and one-row int8 and int4 products (int8_matvec.cpp,
gapless::int8_vnni_mm; int4_matvec.cpp, gapless::int4_vnni_mm; where the CPU has AVX-512
VNNI).

They are built into one library against torch's headers with the machine's C++ compiler the
first time a runner asks for it (seconds, the sources side by side) and kept under
`<cache dir>/kernels`, keyed by the sources, flags, torch's version and the CPU's features;
loading it registers the operators' cpu kernels. They join torch's OpenMP runtime rather than
starting a second thread team. Where it cannot be built (no compiler), or for a storage type
it lacks, attention takes torch's path and int8 and int4 layers torch's kernels.

why an operator of torch's rather than a plain C function called through ctypes: at batch 1
the call is most of the work, and ctypes' arguments, the Python in between and the dispatcher
took most of a layer's attention, once per layer a step.

why a kernel of our own: torch's path gathers each decode's K and V blocks into a dense copy,
then runs SDPA over it, a large share of a compiled batch-32 step. This kernel reads each
cached row once, in place, a sequence per task, several times faster than torch's path
(`make bench`'s test_bench_decode_attention_of_a_step; the whole step: `python -m
gapless.bench.cpu_step --batch 32 [-- --no-attention-kernel]`). A task per (sequence, KV head)
instead, which reads a third of each row, took twice as long on cold caches. On a CPU with
AVX-512 BF16, bfloat16 caches take the source's vector path. The figures: bench/RESULTS.md,
"the paged decode kernel" and "attention's vector path, fused projections, numpy's argmax".
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import subprocess
from pathlib import Path

import torch

from gapless.common.model_cache import cache_dir

log = logging.getLogger("gapless.gpu_runner")

SOURCES = [
    Path(__file__).with_name(name)
    for name in ("paged_decode.cpp", "int8_matvec.cpp", "int4_matvec.cpp")
]
FLAGS = ["-O3", "-march=native", "-std=c++20", "-fPIC", "-fopenmp"]
DTYPES = (torch.float32, torch.bfloat16)


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
    objs = [tmp.with_suffix(f".{source.stem}.o") for source in SOURCES]
    # why compile and link apart: `-fopenmp` at link time names the system's libgomp, a second
    # runtime beside the one torch loaded, whose threads would fight torch's for the cores
    link = [runtime] if runtime else ["-fopenmp"]
    from torch.utils import cpp_extension

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    includes = [f"-I{p}" for p in cpp_extension.include_paths()]
    libs = cpp_extension.library_paths()
    torch_libs = [f"-L{p}" for p in libs] + [f"-Wl,-rpath,{p}" for p in libs]
    torch_libs += ["-lc10", "-ltorch_cpu"]
    try:
        # why side by side: each source takes seconds with torch's headers, a cold start's wait
        compiles = [
            subprocess.Popen([compiler, *FLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *includes,
                              "-c", str(source), "-o", str(obj)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for source, obj in zip(SOURCES, objs, strict=True)
        ]  # fmt: skip
        errors = [proc.communicate()[1] for proc in compiles]  # every one ends before a raise
        for proc, err in zip(compiles, errors, strict=True):
            if proc.returncode:
                raise subprocess.CalledProcessError(proc.returncode, proc.args, stderr=err)
        subprocess.run([compiler, "-shared", *map(str, objs), *link, *torch_libs, "-o", str(tmp)],
                       check=True, capture_output=True, text=True)  # fmt: skip
        os.replace(tmp, out)  # why: runners that start together each build, one file wins
    except subprocess.CalledProcessError as e:
        raise RuntimeError(f"{' '.join(map(str, e.cmd))} failed:\n{e.stderr}") from e
    finally:
        for obj in objs:
            obj.unlink(missing_ok=True)
        tmp.unlink(missing_ok=True)


_LIB = torch.library.Library("gapless", "FRAGMENT")
# the schema lives here, so a compiled graph can name the operator before the kernel is loaded;
# k, v and slot_mapping (the step's new rows, written to the caches first) come together or not
_LIB.define(
    "paged_decode(Tensor q, Tensor? k, Tensor? v, Tensor(a!) k_cache, Tensor(b!) v_cache, "
    "Tensor? slot_mapping, Tensor pages, Tensor ctx, float scale, int block_size, "
    "int window=0, float softcap=0.) -> Tensor"
)


@torch.library.register_fake("gapless::paged_decode")
def _(q, k, v, k_cache, v_cache, slot_mapping, pages, ctx, scale, block_size, window=0,
      softcap=0.0):  # fmt: skip
    return q.new_empty(q.shape)  # contiguous, as the kernel's output


# y = x W^T, W [N, K] int8 stored as uint8 (w + 128), float32 scales [N] -> [M, N] float32;
# registered only where the compiler targets AVX-512 VNNI (int8_matvec.cpp)
_LIB.define("int8_vnni_mm(Tensor x, Tensor weight, Tensor scales) -> Tensor")


@torch.library.register_fake("gapless::int8_vnni_mm")
def _(x, weight, scales):
    return x.new_empty((x.shape[0], weight.shape[0]), dtype=torch.float32)


# y = x W^T, W [N, K] in blocks of 32 columns, w = d q + m: codes [N, K / 2] uint8 in the
# kernel's order (quant.int4_vnni_codes), d and m [N, K / 32] float16 -> [M, N] float32;
# registered only where the compiler targets AVX-512 VNNI (int4_matvec.cpp)
_LIB.define("int4_vnni_mm(Tensor x, Tensor codes, Tensor d, Tensor m) -> Tensor")


@torch.library.register_fake("gapless::int4_vnni_mm")
def _(x, codes, d, m):
    return x.new_empty((x.shape[0], codes.shape[0]), dtype=torch.float32)


_loaded: Path | None = None  # the library this process loaded; the operator is registered once


@functools.cache
def library() -> Path | None:
    """The built kernel, loaded (its operator registered), or None (logged once) where it
    cannot be built."""
    global _loaded
    if _loaded is not None:
        return _loaded
    key = hashlib.sha256(
        b"".join(source.read_bytes() for source in SOURCES)
        + " ".join(FLAGS).encode()
        + torch.__version__.encode()
        + _cpu_features().encode()
    ).hexdigest()[:16]
    path = cache_dir() / "kernels" / f"cpu_kernels-{key}.so"
    try:
        if not path.exists():
            log.info("building the cpu kernels (once, ~9 s): %s", path)
            _build(path)
        torch.ops.load_library(str(path))
    except (OSError, RuntimeError) as e:
        log.warning("cpu attention kernel unavailable, using torch's: %s", e)
        return None
    _loaded = path
    return path


def available(dtype: torch.dtype) -> bool:
    return dtype in DTYPES and library() is not None


def has_vnni(op: str) -> bool:
    """Whether gapless::`op` (int8_vnni_mm, int4_vnni_mm) runs here: the library built for a
    CPU with AVX-512 VNNI."""
    return library() is not None and torch._C._dispatch_has_kernel_for_dispatch_key(
        f"gapless::{op}", "CPU"
    )


def paged_decode(
    q: torch.Tensor,  # [D, H, d]
    k_cache: torch.Tensor,  # [R, KVH, d]
    v_cache: torch.Tensor,
    pages: torch.Tensor,  # [D, P] long
    ctx: torch.Tensor,  # [D] long, each in 1..P * block_size
    scale: float,
    block_size: int,
    writes: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    window: int = 0,  # keys each query sees, its own included; 0: the whole context
    softcap: float = 0.0,  # scores s -> softcap * tanh(s / softcap); 0: none
) -> torch.Tensor:  # [D, H, d]
    """Decode attention over the paged cache; `writes` (k, v [W, KVH, d], slots [W] long) go
    into the cache first. Needs available(q.dtype)."""
    assert library() is not None and q.dtype in DTYPES, "the kernel is built for this dtype"
    k, v, slots = writes if writes is not None else (None, None, None)
    return torch.ops.gapless.paged_decode(
        q, k, v, k_cache, v_cache, slots, pages, ctx, scale, block_size, window, softcap
    )
