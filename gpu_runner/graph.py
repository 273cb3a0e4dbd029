"""The graph layer: decode steps of padded batch sizes over the persistent batch's static buffers.

A decode-only batch of B entries runs as padded_size(B) entries; the dummies write their K/V into
block 0 and their logits are never sampled. On cuda each size is a CUDA graph captured at start
and replayed per step; on cpu (or with --no-cuda-graph) the same function runs eagerly, so the
padding is exercised wherever the runner runs.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from itertools import chain, count
from typing import Any

import torch

FIRST_SIZES = (1, 2, 4, 8)
SIZE_STEP = 16  # past the first sizes, every multiple of this


def padded_size(batch: int) -> int:
    """The capture size a decode batch of `batch` entries runs as: 1, 2, 4, 8, then 16k."""
    assert batch >= 1, "an empty batch has no padded size"
    if batch <= FIRST_SIZES[-1]:
        return FIRST_SIZES[bisect.bisect_left(FIRST_SIZES, batch)]
    return -(-batch // SIZE_STEP) * SIZE_STEP


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Every decode size up to max_num_seqs rounded up: 1, 2, 4, 8, 16, 32, ..."""
    sizes = []
    for size in chain(FIRST_SIZES, count(SIZE_STEP, SIZE_STEP)):
        sizes.append(size)
        if size >= max_num_seqs:
            return sizes
    raise AssertionError("unreachable")


# forward(num_rows, meta) -> [num_rows, vocab] float32 logits, reading only static buffers
StepForward = Callable[[int, Any], torch.Tensor]


class DecodeGraphs:
    """Runs padded decode steps: graph replay where captured, else `forward` eagerly."""

    def __init__(self, forward: StepForward, sizes: list[int]) -> None:
        self.forward = forward
        self.sizes = sizes
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # [size, vocab] float32, written by replays
        self.metas: dict[int, Any] = {}

    @property
    def max_size(self) -> int:
        return self.sizes[-1]

    def capture(self, metas: dict[int, Any], prime: Callable[[int], None]) -> None:
        """Capture one graph per size (cuda). metas[size] is the attention metadata object the
        graph reads at every replay; prime(size) fills the static buffers and plans it with
        dummy entries, so warm-up and capture see a valid batch."""
        pool = None
        side = torch.cuda.Stream()
        for size in sorted(self.sizes, reverse=True):  # why: the largest sets the shared pool
            prime(size)
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):  # warm-up: lazy inits and autotuning stay out of the graph
                    self.forward(size, metas[size])
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self.forward(size, metas[size])
            pool = graph.pool()
            self.graphs[size] = graph
            self.metas[size] = metas[size]
        torch.cuda.synchronize()

    def run(self, size: int, meta: Any) -> torch.Tensor:  # [size, vocab] float32
        assert size in self.sizes, f"decode batch {size} is not a capture size"
        graph = self.graphs.get(size)
        if graph is None:
            return self.forward(size, meta)
        assert meta is self.metas[size], "a replay must read the metadata it was captured with"
        graph.replay()
        return self.outputs[size]
