"""The cpu device's compiled decode step: each decoder layer of a decode-only batch through
torch.compile (inductor's C++/OpenMP code), so its element-wise work fuses and the paged
attention reads K and V straight from the cache.

One compiled function serves every layer (its weights are inputs) and every padded batch
size: the batch and the context are dynamic dimensions. Sizes of 1 are specialized by the
compiler, so a batch of one and batches of two or more are two compilations; both are made
at start, before the runner reports ready. Only a step's first layer is called through
torch.compile; the others replay the graph it chose with their own weights (CompiledLayers),
as a captured CUDA graph is replayed, and a step like one before (its inputs the same in kind,
shape and value) replays that graph from the first layer on. Compiled code is cached on disk
(inductor's FX graph cache under `<cache dir>/inductor`, set in gpu_runner/__init__.py), so a
warm start only traces. Prefill chunks and mixed steps stay eager.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import time
import types
import weakref
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
    # why: ~25 checks of sizes and strides a layer, a measurable share of a batch-1 step
    # (bench/RESULTS.md, "the layers replay the compiled graph"); a replayed layer's own
    # inputs are checked against the first layer's once, when first seen
    "size_asserts": False,
}
_ARGS = ("layer", "x", "cos", "sin", "kv", "meta")  # run_layer's, as dynamo's sources name them
_PER_LAYER = ("layer", "kv")  # the arguments whose inputs differ by layer


def _root(arg) -> str | None:
    """Which of run_layer's arguments a graph input comes from; None for anything else (an
    input of a frame inside a layer, after a graph break there)."""
    source = getattr(arg, "source", None)
    while source is not None and hasattr(source, "base"):  # a chain of lookups from a local
        source = source.base
    name = getattr(source, "local_name", None)
    return name if name in _ARGS else None


class _Graph:
    """One compiled graph of run_layer and where each of its inputs comes from (dynamo's graph
    arguments): the layer's own (weights, its KV cache), its input x, or the step's (the rest).
    Holds nothing of a model: a runner dropped is freed."""

    def __init__(self, fn: Callable, gm: torch.fx.GraphModule) -> None:
        self.fn = fn
        self.x = -1  # x's position; -1: the graph is not replayed
        self.per_layer: list[tuple[int, Any, bool]] = []  # position, source, float as tensor
        self.step: list[int] = []  # positions of the step's inputs (x, cos, sin, meta's)
        # the step's inputs from run_layer's locals, as dynamo gathers them; None: not fetched
        self.fetch: Callable[[dict], tuple] | None = None
        x = -1
        names: list[str] | None = []
        for pos, node in enumerate(n for n in gm.graph.nodes if n.op == "placeholder"):
            arg = node.meta.get("grapharg")
            root = _root(arg)
            if root is None:
                return
            if root == "x" and arg.source.name == "L['x']":
                x = pos
            if root in _PER_LAYER:
                self.per_layer.append((pos, arg.source, arg.pass_arg_as_tensor))
            elif names is not None and not arg.pass_arg_as_tensor:
                self.step.append(pos)
                names.append(arg.source.name)
            else:
                names = None  # a step input passed in another form than its value
        self.x = x
        if names is not None:
            # why code of the sources' names: they are the expressions dynamo evaluates in the
            # frame (L['meta'].decode_pages.size()[1]); Source.get_value evals each, slowly
            try:
                self.fetch = eval(f"lambda L: ({''.join(n + ', ' for n in names)})")  # noqa: S307
            except SyntaxError:
                self.fetch = None

    def fetched(self, frame: dict) -> tuple | None:
        """The step's inputs of this graph from run_layer's locals; None where they cannot be
        fetched (then the compiler gathers them, as it always can)."""
        if self.fetch is None:
            return None
        try:
            return self.fetch(frame)
        except (AttributeError, KeyError, IndexError, TypeError, NameError):
            self.fetch = None
            return None

    def inputs_of(self, layer, kv, first: tuple) -> list[tuple[int, object]] | None:
        """The layer's own inputs; None where they differ in kind from the first layer's
        (another module structure, dtype, shape or strides)."""
        frame = {"L": {"layer": layer, "kv": kv}}  # the function's locals, as dynamo names them
        found: list[tuple[int, object]] = []
        try:
            for pos, source, as_tensor in self.per_layer:
                value = source.get_value({}, frame, {})
                if as_tensor:
                    value = torch._as_tensor_fullprec(value)
                if not _alike(value, first[pos]):
                    return None
                found.append((pos, value))
        except (AttributeError, KeyError, IndexError, TypeError):
            return None
        return found


def _kind(layer) -> object:
    """What a layer's graph holds as constants (gpu_runner/model's DecoderLayer.kind)."""
    return getattr(layer, "kind", None)


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


def _signature(values: tuple, meta) -> tuple:
    """What a compiled step's guards can read of its inputs: each tensor's kind, shape and
    layout, each number's value, and every field of the attention metadata (a tensor by its
    kind and shape, a list by its length, the rest by value)."""
    if dataclasses.is_dataclass(meta):
        fields = [getattr(meta, f.name) for f in dataclasses.fields(meta)]
    elif hasattr(meta, "__dict__"):
        fields = list(vars(meta).values())
    else:
        return (object(),)  # why: metadata of unknown fields never matches again
    return tuple(_describe(v) for v in (*values, *fields))


def _describe(v) -> object:
    if isinstance(v, torch.Tensor):
        return (v.dtype, v.shape, v.stride(), v.storage_offset(), v.device, v.requires_grad)
    if isinstance(v, (list, tuple, dict)):
        return (type(v), len(v))
    return (type(v), v)


class CompiledLayers:
    """The decoder layers of a decode step, compiled as one function of (layer, x, ...) for
    every layer and batch size, and run like a captured graph: the first layer goes through
    torch.compile (its guards choose, or make, the graph for this step's shapes); the other
    layers call that graph directly with their own weights and cache in place of the first
    layer's, so no guards, frame evaluation or argument gathering run for them.

    A layer is replayed only when the first layer's call ran exactly one graph whose every
    input comes from run_layer's arguments (a graph break inside a layer makes several, or
    inputs of the layer's own frames), when it is of the first layer's kind (`layer.kind`:
    its window, RoPE and MLP, which a graph holds as constants) and when its own inputs match
    the first layer's in dtype, shape and strides. Otherwise it runs eagerly: the compiler
    would take the same graph without checking, as its guards skip the layers' modules.

    why: per layer, dynamo's cache lookup and the bytecode that gathers the graph's inputs
    cost the same whatever the step's size; replayed, the decode step is faster at batch 1
    and at batch 32, with the same tokens (bench/RESULTS.md, "the layers replay the compiled
    graph").
    """

    def __init__(self) -> None:
        # why a copy of the code: compiled graphs are kept per code object and, without guards
        # on the layers, would be taken for another model of the same shapes in this process (a
        # bench timing bf16 then int4); a copy per runner keeps them apart. Its own globals:
        # the compiler puts each compiled graph there, and they go with this copy
        fresh = types.FunctionType(
            run_layer.__code__.replace(), dict(run_layer.__globals__), "run_layer"
        )
        owner = weakref.ref(self)  # why: the compiler keeps the backend; it must not keep us
        self.compiled = torch.compile(
            fresh,
            backend=lambda gm, example_inputs: owner()._backend(gm, example_inputs),
            dynamic=True,
            # why: weights change nothing between calls; guarding each layer's parameters costs
            # more per call than the fused kernels save
            options={"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe},
        )
        self._ran: list[tuple[_Graph, tuple]] = []  # graphs run by the call in progress
        # the graph the compiler chose last, its inputs then, and the signatures of the steps
        # it was chosen for (see _first_layer)
        self._last: tuple[_Graph, tuple, set] | None = None
        # (graph, layer index) -> the layer and cache its inputs were found for, and them
        self._inputs: dict[tuple[_Graph, int], tuple[object, object, list | None]] = {}
        self.replay = True  # False: every layer through the compiler (to compare)
        self.direct = True  # False: the first layer through the compiler (to compare)
        self.num_graphs = 0  # graphs compiled (or loaded from the cache)
        self.num_replayed = 0  # layers run by replay rather than through the compiler
        self.num_direct = 0  # steps whose first layer, too, ran without the compiler

    def _backend(self, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        from torch._inductor.compile_fx import compile_fx

        graph = _Graph(compile_fx(gm, example_inputs, config_patches=INDUCTOR), gm)
        self.num_graphs += 1
        owner = weakref.ref(self)  # why: the compiler keeps `run` too

        def run(*args):
            layers = owner()
            if layers is not None:
                layers._ran.append((graph, args))
            return graph.fn(*args)

        return run

    def _own_inputs(self, graph: _Graph, i: int, layer, kv, first: tuple) -> list | None:
        known = self._inputs.get((graph, i))
        if known is not None and known[0] is layer and known[1] is kv:
            return known[2]
        found = graph.inputs_of(layer, kv, first)
        self._inputs[graph, i] = (layer, kv, found)
        return found

    def _first_layer(self, frame: dict) -> tuple[_Graph, tuple] | None:
        """The graph and inputs for this step's first layer without the compiler, where the
        compiler chose that graph for a step of the same signature before; else None.

        why: dynamo's guards, cache lookup and input gathering are a large share of the first
        layer's time (bench/RESULTS.md, "one stream's step"); the same inputs in kind, shape
        and value pass the same guards, so the graph they chose serves again."""
        if self._last is None:
            return None
        graph, first, seen = self._last
        values = graph.fetched(frame)
        if values is None or _signature(values, frame["meta"]) not in seen:
            return None
        own = self._own_inputs(graph, 0, frame["layer"], frame["kv"], first)
        if own is None:
            return None
        args = list(first)
        for pos, value in zip(graph.step, values, strict=True):
            args[pos] = value
        for pos, value in own:
            args[pos] = value
        return graph, tuple(args)

    def _chose(self, graph: _Graph, first: tuple, frame: dict) -> None:
        """Note the compiler's choice for this step, where the graph's step inputs can be
        fetched: the same sources must give the very values dynamo passed."""
        if graph.x < 0:
            return
        values = graph.fetched(frame)
        same = values is not None and all(
            v is first[pos] if isinstance(v, torch.Tensor) else _alike(v, first[pos])
            for pos, v in zip(graph.step, values, strict=True)
        )
        if not same:
            graph.fetch = None
            if self._last is not None and self._last[0] is graph:
                self._last = None
            return
        seen = self._last[2] if self._last is not None and self._last[0] is graph else set()
        seen.add(_signature(values, frame["meta"]))
        self._last = (graph, first, seen)

    def __call__(self, layers, x, cos, sin, kv_cache, meta) -> torch.Tensor:
        # the first layer's locals, as dynamo's sources name run_layer's
        frame = {"layer": layers[0], "x": x, "cos": cos, "sin": sin, "kv": kv_cache[0],
                 "meta": meta}  # fmt: skip
        direct = self._first_layer(frame) if self.replay and self.direct else None
        if direct is not None:
            graph, first = direct
            x = graph.fn(*first)[0]
            self.num_direct += 1
        else:
            self._ran.clear()
            x = self.compiled(layers[0], x, cos, sin, kv_cache[0], meta)
            ran, self._ran = self._ran, []
            if not self.replay or len(ran) != 1 or ran[0][0].x < 0:
                for i in range(1, len(layers)):
                    if _kind(layers[i]) == _kind(layers[0]):
                        x = self.compiled(layers[i], x, cos, sin, kv_cache[i], meta)
                    else:  # why eager: the compiler would take this graph for it unchecked
                        x = layers[i](x, cos, sin, kv_cache[i], meta)
                return x
            graph, first = ran[0]
            self._chose(graph, first, frame)
        pos_x = graph.x
        # why checked only here and after an eager layer: a replayed layer's output has the
        # first layer's shape and strides, being the same graph's over the same sizes
        x_fits = _alike(x, first[pos_x])
        kind = _kind(layers[0])
        for i in range(1, len(layers)):
            fits = x_fits and _kind(layers[i]) == kind
            own = self._own_inputs(graph, i, layers[i], kv_cache[i], first) if fits else None
            if own is None:
                x = layers[i](x, cos, sin, kv_cache[i], meta)
                x_fits = _alike(x, first[pos_x])
                continue
            args = list(first)
            args[pos_x] = x
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
