"""What --dtype auto and --quantization auto mean on a device: the number formats of the weights
and activations, chosen from what the CPU computes natively.

The figures behind each rule are in bench/RESULTS.md ("float32 at --dtype auto", "int8 weights,
float32 activations", "w8a8", "int4-dual").
"""

from __future__ import annotations

import torch

from gapless.gpu_runner.cpu.quant import holds_q4_1

BF16_CPU_FLAGS = {"avx512_bf16", "amx_bf16", "bf16"}  # /proc/cpuinfo: x86 flags, Arm features


def resolve_dtype(dtype: str, device: str) -> str:
    """--dtype auto: bfloat16 on cuda, and on a CPU that computes it natively, else float32.

    why: without bfloat16 instructions torch converts through float32 inside every matmul, and
    the matmuls of a batch take several times longer than in float32; where the CPU has them,
    bfloat16 is the faster."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if device != "cpu" or BF16_CPU_FLAGS & cpu_flags() else "float32"


def resolve_quantization(
    quantization: str, dtype: str, device: str, model_path: str | None = None
) -> str:
    """--quantization auto, on a cpu where --dtype auto gives float32: w8a8 where torch has
    fbgemm's int8 kernels (x86), else int8; where it gives bfloat16: int4-dual for a Q4_1
    GGUF, whose weights int4 holds exactly; none elsewhere (an explicit --dtype float32 keeps
    float32 weights: the exact path).

    why: a decode step reads every weight once a token, and a float32 weight is 4 bytes; int8
    weights decode one stream faster and serve a batch at least as fast, and w8a8 serves a
    batch faster still, each at a small cost in perplexity. Where bfloat16 is native, bfloat16
    weights serve a batch faster than int8 or int4, and int4 one stream: int4-dual takes each
    where it wins."""
    if quantization != "auto":
        return quantization
    if device != "cpu" or dtype != "auto":
        return "none"
    if resolve_dtype("auto", device) == "float32":
        return "w8a8" if has_fbgemm() else "int8"
    return "int4-dual" if model_path and holds_q4_1(model_path) else "none"


def has_fbgemm() -> bool:
    """Whether this torch has fbgemm's int8 cpu kernels (x86 builds)."""
    return "fbgemm" in torch.backends.quantized.supported_engines


def cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo; empty where there is none."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return set(line.partition(":")[2].split())
    except OSError:
        pass
    return set()
