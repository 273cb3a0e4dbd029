"""What the cuda device does between loading its weights and reporting ready, each stage logged
with its time ("cuda startup: ..."):

1. kernels: a prompt step's and a decode step's attention are planned once, side by side
   (flashinfer compiles each kind's kernels the first time it plans them: minutes with an
   empty cache, two compiles at once);
2. the largest step (gpu_runner/cuda/warmup.py) runs once, and a decode of the largest graph size
   eagerly, each with its memory peak measured;
3. the KV cache: sized from those peaks (gpu_runner/cuda/memory.py) unless --kv-cache-memory gives
   its size; the warm-up's blocks are freed first;
4. CUDA graphs: every decode size captured (each run twice before its capture).

Nothing a request meets later is compiled or captured for the first time.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import numpy as np
import torch

from gapless.common.config import EngineConfig, max_seq_blocks, max_useful_blocks
from gapless.gpu_runner.attention import StepLayout
from gapless.gpu_runner.batch import SLOT_MAPPING
from gapless.gpu_runner.cuda.memory import GIB, MemoryPlan, kv_cache_blocks, plan_memory
from gapless.gpu_runner.cuda.warmup import WarmupStep, run_warmup, warmup_step
from gapless.gpu_runner.executor import StepExecutor
from gapless.gpu_runner.kv_cache import kv_block_bytes

log = logging.getLogger("gapless.gpu_runner")
PREFIX = "cuda startup: "  # the check (bench/gpu_check) reads these lines from the log


class Stages:
    """Times each stage since the last one and logs it."""

    def __init__(self, since: float) -> None:
        self.last = since
        self.seconds: dict[str, float] = {}

    def done(self, name: str, what: str) -> None:
        now = time.perf_counter()
        self.seconds[name] = now - self.last
        log.info("%s%s in %.1fs%s", PREFIX, name, now - self.last, what)
        self.last = now


def sizes_by_kv(config: EngineConfig) -> bool:
    """Whether the KV cache is sized from measured memory (no --kv-cache-memory)."""
    return config.kv_cache_memory is None


def first_blocks(config: EngineConfig) -> int:
    """Blocks to allocate before measuring, where the cache is sized from memory: the warm-up
    step's."""
    c = config
    cap = max_useful_blocks(c.max_num_seqs, c.model.max_model_len, c.block_size)
    step = warmup_step(c.max_num_batched_tokens, c.max_num_seqs, c.model.max_model_len,
                       c.block_size, cap - 1)  # fmt: skip
    return min(step.num_blocks + 1, cap)


def build_kernels(runner: StepExecutor) -> None:
    """Plan a two-token prompt and a three-entry decode at once, in two threads: each plan
    compiles (or loads) its kind's kernels for every window the model has."""
    bs, one = runner.config.block_size, np.ones(3, np.int64)
    layouts = [
        StepLayout(np.array([2]), np.array([2]), np.zeros((1, 1), np.int64), bs),
        StepLayout(one, one, np.zeros((3, 1), np.int64), bs),
    ]
    errors: list[BaseException] = []

    def plan(layout: StepLayout) -> None:
        try:
            rows = int(layout.num_tokens.sum())
            runner.attn.build(layout, runner.batch.column(SLOT_MAPPING, rows))
        except BaseException as e:  # re-raised on the main thread
            errors.append(e)

    threads = [threading.Thread(target=plan, args=(layout,)) for layout in layouts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    torch.cuda.synchronize()


def peak_above(fn) -> int:
    """Bytes torch's allocator held at fn's peak above what it held before."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return max(0, torch.cuda.max_memory_allocated() - base)


def warm_up(runner: StepExecutor) -> tuple[WarmupStep, int, int]:
    """The largest step and the largest decode batch, once each: (the step, its peak, the
    decode's peak), bytes above what was held before each."""
    c = runner.config
    step = warmup_step(c.max_num_batched_tokens, c.max_num_seqs, c.model.max_model_len,
                       c.block_size, runner.num_blocks - 1)  # fmt: skip
    with torch.inference_mode():
        step_peak = peak_above(lambda: run_warmup(runner, step))
        decode_peak = peak_above(lambda: runner.prime_decode(runner.graphs.max_size))
    return step, step_peak, decode_peak


def size_kv_cache(
    runner: StepExecutor, step_peak: int, graphs: int, free_at_start: int
) -> MemoryPlan:
    """Free the warm-up's cache, measure what stays, and allocate the KV cache in the rest
    (free_at_start: the device's free bytes when this process began, its context made)."""
    c = runner.config
    runner.kv_cache = None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    static = torch.cuda.memory_allocated()
    other = max(0, free_at_start - free - torch.cuda.memory_reserved())
    plan = plan_memory(total, c.gpu_memory_utilization, static, step_peak, graphs, other, free)
    per_block = kv_block_bytes(runner.arch, c.block_size, runner.dtype)
    cap = max_useful_blocks(c.max_num_seqs, c.model.max_model_len, c.block_size)
    runner.num_blocks = kv_cache_blocks(plan, per_block, cap)
    if runner.model.tp is not None:  # the core sees one pool: what every rank can hold
        runner.num_blocks = runner.model.tp.min(runner.num_blocks, runner.device)
    runner.kv_cache = runner.make_kv_cache(runner.num_blocks)
    # a sequence's block table as long as this cache lets it be, before any graph holds one
    runner.batch.resize_tables(max_seq_blocks(c.model.max_model_len, c.block_size,
                                              runner.num_blocks))  # fmt: skip
    runner.attn.max_blocks_per_seq = runner.batch.max_blocks_per_seq
    return plan


def start(
    runner: StepExecutor, capture: Callable[[], None], since: float, free_at_start: int
) -> dict[str, int]:
    """Stages 1-4 on an executor whose weights are loaded (capture: stage 4, the backend's;
    since: perf_counter at the start of the load; free_at_start: the device's free bytes
    then); the ready message's extra fields (bytes and ms)."""
    c = runner.config
    stages = Stages(since)
    weights = torch.cuda.memory_allocated()
    stages.done("weights loaded", f" ({weights / GIB:.2f} GiB on the GPU with the first buffers)")
    build_kernels(runner)
    windows = len(runner.attn.windows)
    stages.done("kernels built", f" (prompt and decode attention, {windows} window(s))")
    step, step_peak, decode_peak = warm_up(runner)
    stages.done(
        "largest step run",
        f": {step.num_tokens} prompt tokens over {len(step.lengths)} sequences "
        f"({step_peak / GIB:.2f} GiB above the weights), then a decode of "
        f"{runner.graphs.max_size} ({decode_peak / GIB:.2f} GiB)",
    )
    info: dict[str, int] = {}
    if sizes_by_kv(c):
        graphs = decode_peak if runner.use_graphs else 0
        plan = size_kv_cache(runner, step_peak, graphs, free_at_start)
        info.update(memory_budget_bytes=plan.budget, memory_total_bytes=plan.total)
        stages.done(
            "KV cache sized",
            f": {runner.num_blocks} blocks ({runner.num_blocks * c.block_size} tokens), "
            + plan.describe(c.gpu_memory_utilization),
        )
    else:
        for kv in runner.kv_cache:  # why: requests see no trace of the warm-up
            for cache in kv:
                cache.zero_()
        kept = runner.num_blocks * kv_block_bytes(runner.arch, c.block_size, runner.dtype)
        stages.done(
            "KV cache kept",
            f": {runner.num_blocks} blocks ({runner.num_blocks * c.block_size} tokens, "
            f"{kept / GIB:.2f} GiB, --kv-cache-memory)",
        )
    info["kv_cache_bytes"] = runner.num_blocks * kv_block_bytes(runner.arch, c.block_size,
                                                                runner.dtype)  # fmt: skip
    if runner.use_graphs:
        capture()
        sizes = runner.graphs.sizes
        stages.done("CUDA graphs captured", f": {len(sizes)} decode sizes, {sizes[0]}-{sizes[-1]}")
    info["startup_ms"] = int((time.perf_counter() - since) * 1e3)
    for name, seconds in stages.seconds.items():
        info[STAGE_KEYS[name]] = int(seconds * 1e3)
    return info


# each stage's time in the READY message, ms
STAGE_KEYS = {"weights loaded": "load_ms", "kernels built": "kernels_ms",
              "largest step run": "warmup_ms", "KV cache sized": "kv_sizing_ms",
              "KV cache kept": "kv_sizing_ms", "CUDA graphs captured": "graphs_ms"}  # fmt: skip
