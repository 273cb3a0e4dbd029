"""The cpu device's compiled decode step: each decoder layer of a decode-only batch through
torch.compile (inductor's C++/OpenMP code), so its element-wise work fuses and the paged
attention reads K and V straight from the cache.

One compiled function serves every layer (its weights are inputs) and every padded batch
size: the batch and the context are dynamic dimensions. Sizes of 1 are specialized by the
compiler, so a batch of one and batches of two or more are two compilations; both are made
at start, before the runner reports ready. Only a step's first layer is called through
torch.compile; the others replay the graph it chose with their own weights (CompiledLayers),
as a captured CUDA graph is replayed. Compiled code is cached on disk (inductor's FX graph
cache under `<cache dir>/inductor`, set in gpu_runner/__init__.py), so a warm start only
traces. Prefill chunks and mixed steps stay eager.
"""

from __future__ import annotations

import logging
import sys
import time
import types
from collections.abc import Callable
from typing import Any

import torch

log = logging.getLogger("gapless.gpu_runner")

WARM_SIZES = (1, 2)  # batch sizes that compile: 1 is specialized, 2 stands for every larger one


def run_layer(layer, x, cos, sin, kv, meta) -> torch.Tensor:
    return layer(x, cos, sin, kv, meta)


INDUCTOR = {
    # why one thread in generated code: a decode step's element-wise tensors are small, and a
    # parallel region per kernel costs more in wake-ups than it saves (the matmuls, which the
    # compiler leaves to torch, keep --threads)
    "cpp.threads": 1,
    # why: ~25 checks of sizes and strides a layer, ~0.4 ms of a 6.4 ms step at batch 1 (5.97
    # against 6.39 ms, medians of 6 alternating runs in one process; batch 32 unchanged); a
    # replayed layer's own inputs are checked against the first layer's once, when first seen
    "size_asserts": False,
}
_PER_LAYER = ("L['layer']", "L['kv']")  # where a graph input that differs by layer comes from


class _Graph:
    """One compiled graph and where each of its inputs comes from (dynamo's graph arguments):
    the layer's own (weights, its KV cache), the layer's input x, or the step's (the rest)."""

    def __init__(self, fn: Callable, gm: torch.fx.GraphModule) -> None:
        self.fn = fn
        self.x = -1
        self.per_layer: list[tuple[int, Any, bool]] = []  # position, source, float as tensor
        # by layer index: the layer and cache they were found for, and its inputs
        self.layers: dict[int, tuple[object, object, list[tuple[int, object]] | None]] = {}
        for pos, node in enumerate(n for n in gm.graph.nodes if n.op == "placeholder"):
            arg = node.meta.get("grapharg")
            if arg is None or arg.source is None:
                self.x = -2  # an input of no known source: this graph is not replayed
                return
            name = arg.source.name
            if name == "L['x']":
                self.x = pos
            elif name.startswith(_PER_LAYER):
                self.per_layer.append((pos, arg.source, arg.pass_arg_as_tensor))

    @property
    def replayable(self) -> bool:
        return self.x >= 0

    def inputs_of(self, i: int, layer, kv, first: tuple) -> list[tuple[int, object]] | None:
        """Layer i's own inputs, found once per layer and cache; None where they differ in
        kind from the first layer's (another module structure, dtype, shape or strides):
        that layer is called through the compiler instead."""
        known = self.layers.get(i)
        if known is not None and known[0] is layer and known[1] is kv:
            return known[2]
        frame = {"L": {"layer": layer, "kv": kv}}  # the function's locals, as dynamo names them
        found: list[tuple[int, object]] | None = []
        try:
            for pos, source, as_tensor in self.per_layer:
                value = source.get_value({}, frame, {})
                if as_tensor:
                    value = torch._as_tensor_fullprec(value)
                if not _alike(value, first[pos]):
                    found = None
                    break
                found.append((pos, value))
        except (AttributeError, KeyError, IndexError, TypeError):
            found = None
        self.layers[i] = (layer, kv, found)
        return found


def _alike(a, b) -> bool:
    if isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and a.stride() == b.stride()
            and a.device == b.device
        )
    return type(a) is type(b) and a == b


class CompiledLayers:
    """The decoder layers of a decode step, compiled as one function of (layer, x, ...) for
    every layer and batch size, and run like a captured graph: the first layer goes through
    torch.compile (its guards choose, or make, the graph for this step's shapes); the other
    layers call that graph directly with their own weights and cache in place of the first
    layer's, so no guards, frame evaluation or argument gathering run for them.

    why: per layer, dynamo's cache lookup and the bytecode that gathers the graph's inputs
    took ~55 us (torch profiler, batch 32, default model), ~1.6 ms of a step whatever its
    size. Median decode step, default model and settings, 6 alternating runs of 24 steps in one
    process (AMD EPYC, AVX-512, 2 cores, a slow spell of the VM): batch 32, 34.3 ms against
    36.8 (0.93x); batch 1, 6.5 against 7.8 ms (0.83x); the same tokens.
    """

    def __init__(self) -> None:
        # why a copy of the code: compiled graphs are kept per code object and, without guards
        # on the layers, would be taken for another model of the same shapes in this process (a
        # bench timing bf16 then int4); a copy per runner keeps them apart
        fresh = types.FunctionType(run_layer.__code__.replace(), run_layer.__globals__, "run_layer")
        self.compiled = torch.compile(
            fresh,
            backend=self._backend,
            dynamic=True,
            # why: weights change nothing between calls; guarding each layer's parameters costs
            # more per call than the fused kernels save
            options={"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe},
        )
        self._called: tuple[_Graph, tuple] | None = None  # the last graph run, and its inputs
        self.replay = True  # False: every layer through the compiler (to compare)
        self.num_replayed = 0  # layers run by replay rather than through the compiler

    def _backend(self, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        from torch._inductor.compile_fx import compile_fx

        graph = _Graph(compile_fx(gm, example_inputs, config_patches=INDUCTOR), gm)

        def run(*args):
            self._called = (graph, args)
            return graph.fn(*args)

        return run

    def __call__(self, layers, x, cos, sin, kv_cache, meta) -> torch.Tensor:
        self._called = None
        x = self.compiled(layers[0], x, cos, sin, kv_cache[0], meta)
        called, self._called = self._called, None
        for i in range(1, len(layers)):
            own = None
            if self.replay and called is not None and called[0].replayable:
                graph, first = called
                own = graph.inputs_of(i, layers[i], kv_cache[i], first)
            if own is None:
                x = self.compiled(layers[i], x, cos, sin, kv_cache[i], meta)
                continue
            args = list(first)
            args[graph.x] = x
            for pos, value in own:
                args[pos] = value
            x = graph.fn(*args)[0]
            self.num_replayed += 1
        return x


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
