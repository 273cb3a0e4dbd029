"""The cpu device's compiled decode step: each decoder layer of a decode-only batch through
torch.compile (inductor's C++/OpenMP code), so its element-wise work fuses and the paged
attention reads K and V straight from the cache.

One compiled function serves every layer (its weights are inputs) and every padded batch
size: the batch and the context are dynamic dimensions. Sizes of 1 are specialized by the
compiler, so a batch of one and batches of two or more are two compilations; both are made
at start, before the runner reports ready. Compiled code is cached on disk (inductor's FX
graph cache under `<cache dir>/inductor`, set in gpu_runner/__init__.py), so a warm start only traces. Prefill chunks and
mixed steps stay eager.
"""

from __future__ import annotations

import logging
import sys
import time
import types
from collections.abc import Callable

import torch

log = logging.getLogger("gapless.gpu_runner")

WARM_SIZES = (1, 2)  # batch sizes that compile: 1 is specialized, 2 stands for every larger one


def run_layer(layer, x, cos, sin, kv, meta) -> torch.Tensor:
    return layer(x, cos, sin, kv, meta)


def compile_layer() -> Callable:
    """run_layer compiled once for every layer and batch size of one model."""
    import torch._inductor.config as inductor

    # why a copy of the code: compiled graphs are kept per code object and, without guards on
    # the layers, would be taken for another model of the same shapes in this process (a
    # bench timing bf16 then int4); a copy per runner keeps them apart
    fresh = types.FunctionType(run_layer.__code__.replace(), run_layer.__globals__, "run_layer")

    # why one thread in generated code: a decode step's element-wise tensors are small, and a
    # parallel region per kernel costs more in wake-ups than it saves (the matmuls, which
    # the compiler leaves to torch, keep --threads)
    inductor.cpp.threads = 1
    return torch.compile(
        fresh,
        dynamic=True,
        # why: weights change nothing between calls; guarding each layer's parameters costs
        # more per call than the fused kernels save
        options={"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe},
    )


def warm_up(prime: Callable[[int], None], sizes: list[int]) -> float:
    """Compile (or load from the cache) by running prime(size) for each size; seconds taken."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir
    from tqdm import tqdm

    log.info("compiling the cpu decode step (cache %s)", cache_dir())
    start = time.perf_counter()
    bar = tqdm(sizes, desc="compiling decode step", unit="shape", file=sys.stderr,
               leave=False, disable=not sys.stderr.isatty())  # fmt: skip
    for size in bar:
        prime(size)
    took = time.perf_counter() - start
    log.info("compiled the cpu decode step in %.1f s", took)
    return took
