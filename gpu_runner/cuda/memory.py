"""How much of the GPU the KV cache gets (--gpu-memory-utilization): arithmetic over the byte
counts the cuda device measures at start, kept apart so it is tested without a GPU.

The engine may take utilization x the device's memory. Out of that come, measured: what torch
holds before the cache (weights, the persistent batch, sampler tables, attention workspace),
the activations of the largest step above that (a warm-up at --max-num-batched-tokens over
--max-num-seqs entries, sampling and prompt logprobs included), the CUDA graphs' pool (the
activations of the largest decode batch), and what this process took outside torch's allocator
since it started (libraries' workspaces). The KV cache gets the rest, whole blocks of it, and
never more than the memory free now leaves once the step and the graphs have theirs and
FREE_MARGIN stays free: other processes on the same device are not counted in the budget, but
the cache never takes what they hold.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 2**30
FREE_MARGIN = GIB  # bytes left free on the device when other processes hold the rest


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes, on one device."""

    total: int  # the device's memory
    budget: int  # what the engine may take: utilization x total
    static: int  # torch's allocations before the KV cache: weights, buffers, workspaces
    peak_step: int  # the largest step's activations above static
    graphs: int  # the CUDA graphs' memory pool
    other: int  # this process, outside torch's allocator, since it started
    free: int  # free on the device now, the KV cache not yet allocated
    kv_cache: int  # what is left for the KV cache (negative: not enough)

    @property
    def by_free(self) -> bool:
        """Whether the free memory, not the budget, set the KV cache's size."""
        return self.kv_cache < self.budget - self.static - self.peak_step - self.graphs - self.other

    def describe(self, utilization: float) -> str:
        parts = ", ".join(
            f"{name} {value / GIB:.2f}"
            for name, value in (
                ("weights and buffers", self.static),
                ("largest step", self.peak_step),
                ("graphs", self.graphs),
                ("outside torch", self.other),
            )
        )
        text = (
            f"{self.kv_cache / GIB:.2f} GiB of a {self.budget / GIB:.2f} GiB budget "
            f"(--gpu-memory-utilization {utilization:g} of {self.total / GIB:.2f} GiB; "
            f"{parts} GiB)"
        )
        if self.by_free:
            text += f", held to the {self.free / GIB:.2f} GiB free: other processes use the GPU"
        return text


def plan_memory(
    total: int,
    utilization: float,
    static: int,
    peak_step: int,
    graphs: int,
    other: int,
    free: int,
    margin: int = FREE_MARGIN,
) -> MemoryPlan:
    """The KV cache's share of `total` bytes once the others have theirs, within `free`."""
    assert 0 < utilization <= 1, "utilization is a share of the device's memory"
    budget = int(total * utilization)
    kv = min(budget - static - peak_step - graphs - other, free - peak_step - graphs - margin)
    return MemoryPlan(total, budget, static, peak_step, graphs, other, free, kv)


def kv_cache_blocks(plan: MemoryPlan, block_bytes: int, cap: int) -> int:
    """Whole blocks of block_bytes in the plan's KV share, at most cap (what max_num_seqs full
    contexts can use); RuntimeError when fewer than two fit (block 0 is reserved)."""
    blocks = min(max(plan.kv_cache, 0) // block_bytes, cap)
    if blocks < 2:
        raise RuntimeError(
            "no room for the KV cache: "
            + plan.describe(plan.budget / plan.total)
            + "; raise --gpu-memory-utilization, lower --max-num-batched-tokens or "
            "--max-num-seqs, or give --kv-cache-memory"
        )
    return int(blocks)
