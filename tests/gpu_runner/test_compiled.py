"""The compiled cpu decode step: the same greedy tokens as transformers and as the eager step.

Each test pays a compilation (cold in a fresh environment), so they are few; every other test
runs the eager step (--no-compile)."""

from __future__ import annotations

import gc
import weakref
from types import SimpleNamespace

import msgspec
import pytest
import torch

from gapless.common.messages import SamplingParams
from tests.core.test_engine_greedy import GREEDY, reference  # noqa: F401 (a fixture)
from tests.engine_harness import Harness, make_config

# why in file order: the replay tests at the end see the compiler as the runners above leave
# it; run first in a fresh process, test_a_step_whose_metadata_differs_goes_through_the_compiler
# finds no step to skip the compiler for (an open question, not yet understood)
pytestmark = [pytest.mark.slow, pytest.mark.randomly_dont_reorganize]


def _count_compiled_runs(backend) -> list[int]:
    """Sizes of the decode steps that ran through the compiled forward."""
    assert backend.compiled, "the runner did not take the compiled path"
    sizes: list[int] = []
    run = backend.graphs.run
    backend.graphs.run = lambda size, meta: sizes.append(size) or run(size, meta)
    return sizes


def _num_replayed(backend) -> int:
    return backend.graphs.forward.keywords["run_layers"].num_replayed


@pytest.mark.parametrize("kernel", [True, False], ids=["paged-kernel", "torch-attention"])
def test_compiled_greedy_equals_transformers(tiny_model_dir, reference, kernel):  # noqa: F811
    prompts, want = reference
    config = make_config(
        tiny_model_dir, compile=True, max_num_batched_tokens=32, attention_kernel=kernel
    )
    h = Harness(config)
    assert h.backend.attn.kernel == kernel
    sizes = _count_compiled_runs(h.backend)
    arrivals: dict = {}
    for i, p in enumerate(prompts):  # staggered: chunked prefills mixed with decodes, eagerly
        arrivals.setdefault(2 * i, []).append((f"r{i}", p, GREEDY))
    got = h.run(arrivals)
    for i in range(len(prompts)):
        assert got[f"r{i}"] == want[i], f"request {i} (prompt {len(prompts[i])} tokens)"
    assert {1, 4, 8} <= set(sizes), f"decode batches of one and more compiled: {sizes}"
    assert _num_replayed(h.backend) > 0, "layers after the first replayed the compiled graph"
    run_layers = h.backend.graphs.forward.keywords["run_layers"]
    assert run_layers.num_direct > 0, "steps like one before skipped the compiler entirely"


CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about rivers.",
    "List three prime numbers.",
    "Explain what a compiler does in one sentence.",
    "Hi",
]


def test_compiled_and_eager_fp32_agree_on_the_default_model(default_gguf):
    from gapless.common.model_files import load_tokenizer

    eager = make_config(default_gguf, kv_cache_memory=64 * 2**20, max_num_seqs=8)
    tok = load_tokenizer(eager.model)
    prompts = [tok.encode(CHAT.format(q)).ids for q in QUESTIONS]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    # one at a time, then all together: decode batches of 1 and of 8 (5 padded)
    arrivals = {0: [("solo", prompts[0], params)]}
    arrivals[30] = [(f"r{i}", p, params) for i, p in enumerate(prompts)]
    outputs = {}
    for compiled in (False, True):
        h = Harness(msgspec.structs.replace(eager, compile=compiled))
        sizes = _count_compiled_runs(h.backend) if compiled else []
        outputs[compiled] = h.run(arrivals)
        if compiled:
            assert {1, 8} <= set(sizes), sizes
            assert _num_replayed(h.backend) > 0
    assert outputs[True] == outputs[False]
    assert "Paris" in tok.decode(outputs[True]["solo"])


def test_a_failed_compile_falls_back_to_eager(tiny_model_dir, reference, monkeypatch, caplog):  # noqa: F811
    from gapless.gpu_runner.cpu import compiled

    def no_compiler(prime, sizes):
        raise RuntimeError("InvalidCxxCompiler: No working C++ compiler found")

    monkeypatch.setattr(compiled, "warm_up", no_compiler)
    prompts, want = reference
    h = Harness(make_config(tiny_model_dir, compile=True))
    assert not h.backend.compiled
    assert "running it eagerly" in caplog.text and "InvalidCxxCompiler" in caplog.text
    got = h.run({0: [("r0", prompts[0], GREEDY)]})
    assert got["r0"] == want[0]


class _Layer(torch.nn.Module):
    """A decoder layer's call signature over a weight, a float attribute and a cache."""

    def __init__(self, w: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(w, requires_grad=False)
        self.eps = eps

    def forward(self, x, cos, sin, kv, meta):
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        kv[0][meta.slots] = h[:, : kv[0].shape[1]]  # in place, as the cache writes are
        return (h @ self.w.to(h.dtype)) * cos + sin + kv[1].sum()


def _caches(rows: tuple[int, ...]) -> list:
    g = torch.Generator().manual_seed(1)
    return [(torch.zeros(n, 4), torch.randn(n, 4, generator=g)) for n in rows]


def _eager(layers, x, cos, sin, kv_cache, meta) -> torch.Tensor:
    for layer, kv in zip(layers, kv_cache, strict=True):
        x = layer(x, cos, sin, kv, meta)
    return x


def test_replayed_layers_use_their_own_weights_and_fall_back_where_they_differ():
    """Layers after the first replay its graph with their own weights, floats and caches;
    one whose inputs differ in kind from the first's (here a cache of another size) runs
    eagerly instead, and every output and cache write equals the eager loop's."""
    from gapless.gpu_runner.cpu.compiled import CompiledLayers

    gen = torch.Generator().manual_seed(0)
    ws = [torch.randn(8, 8, generator=gen) for _ in range(4)]
    layers = [_Layer(w, eps) for w, eps in zip(ws, (1e-5, 0.5, 1e-5, 2.0), strict=True)]
    meta = SimpleNamespace(slots=torch.tensor([1, 3, 0]))
    sizes = (5, 5, 6, 5)
    run = CompiledLayers()
    for rows in (3, 3, 1):  # the second call reuses the graph; one row takes another
        x, cos, sin = (torch.randn(rows, 8, generator=gen) for _ in range(3))
        meta.slots = meta.slots[:rows]
        want_kv, got_kv = _caches(sizes), _caches(sizes)
        want = _eager(layers, x, cos, sin, want_kv, meta)
        got = run(layers, x, cos, sin, got_kv, meta)
        torch.testing.assert_close(got, want)
        for got_cache, want_cache in zip(got_kv, want_kv, strict=True):
            torch.testing.assert_close(got_cache[0], want_cache[0])
    assert run.num_graphs == 2, "batches of 3 and of 1"
    assert run.num_replayed == 2 * 3, "layers 1 and 3 replayed each call; layer 2 did not"
    assert run.num_direct == 1, "the second call's first layer took the graph of the first"


class _Scaled(_Layer):
    def forward(self, x, cos, sin, kv, meta):
        return super().forward(x, cos, sin, kv, meta) * meta.scale  # a constant to the compiler


def test_a_step_whose_metadata_differs_goes_through_the_compiler():
    """The first layer skips the compiler only for a step like one it chose a graph for, in
    its inputs and in every field of the metadata: here the same shapes with another constant
    (which the compiler burns into the graph) must take another graph."""
    from gapless.gpu_runner.cpu.compiled import CompiledLayers

    gen = torch.Generator().manual_seed(0)
    layers = [_Scaled(torch.randn(8, 8, generator=gen), 1e-5) for _ in range(3)]
    run = CompiledLayers()
    direct = []
    for scale in (0.5, 0.5, 3.0, 3.0, 0.5):
        meta = SimpleNamespace(slots=torch.tensor([1, 3]), scale=scale)
        x, cos, sin = (torch.randn(2, 8, generator=gen) for _ in range(3))
        want = _eager(layers, x, cos, sin, _caches((5, 5, 5)), meta)
        before = run.num_direct
        torch.testing.assert_close(run(layers, x, cos, sin, _caches((5, 5, 5)), meta), want)
        direct.append(run.num_direct - before)
    # the last 0.5 follows a 3.0: the compiler's guards choose, as the graph noted is 3.0's
    assert direct == [0, 1, 0, 1, 0]


def test_a_step_whose_inputs_cannot_be_fetched_goes_through_the_compiler():
    """Where the step's inputs cannot be fetched from their sources (here a fetch that
    fails), the first layer takes the compiler, as it always can, and fetching stops."""
    from gapless.gpu_runner.cpu.compiled import CompiledLayers

    gen = torch.Generator().manual_seed(0)
    layers = [_Layer(torch.randn(8, 8, generator=gen), 1e-5) for _ in range(3)]
    meta = SimpleNamespace(slots=torch.tensor([1, 3]))
    run = CompiledLayers()

    def step():
        x, cos, sin = (torch.randn(2, 8, generator=gen) for _ in range(3))
        want = _eager(layers, x, cos, sin, _caches((5, 5, 5)), meta)
        torch.testing.assert_close(run(layers, x, cos, sin, _caches((5, 5, 5)), meta), want)

    step()
    graph = run._last[0]

    def broken(frame):
        raise KeyError("meta")

    graph.fetch = broken
    step()
    step()
    assert run.num_direct == 0 and graph.fetch is None
    assert run.num_replayed == 3 * 2, "the other layers still replay"


class _Breaking(_Layer):
    def forward(self, x, cos, sin, kv, meta):
        h = x * 2
        torch._dynamo.graph_break()
        return super().forward(h, cos, sin, kv, meta)


def test_a_graph_break_in_a_layer_is_never_replayed():
    """The compiler splits such a layer into graphs of its own frames; replaying one of them
    would run part of a layer, so every layer goes through the compiler, as without replay."""
    from gapless.gpu_runner.cpu.compiled import CompiledLayers

    gen = torch.Generator().manual_seed(0)
    layers = [_Breaking(torch.randn(8, 8, generator=gen), 1e-5) for _ in range(3)]
    meta = SimpleNamespace(slots=torch.tensor([1, 3]))
    x, cos, sin = (torch.randn(2, 8, generator=gen) for _ in range(3))
    run = CompiledLayers()
    got = run(layers, x, cos, sin, _caches((5, 5, 5)), meta)
    torch.testing.assert_close(got, _eager(layers, x, cos, sin, _caches((5, 5, 5)), meta))
    assert run.num_graphs >= 1 and run.num_replayed == 0


def test_a_dropped_runner_frees_its_layers():
    """The compiler keeps what our backend returns; it must not keep the model with it."""
    from gapless.gpu_runner.cpu.compiled import CompiledLayers

    layers = [_Layer(torch.randn(8, 8), 1e-5) for _ in range(3)]
    meta = SimpleNamespace(slots=torch.tensor([0, 2]))
    run = CompiledLayers()
    run(layers, *(torch.randn(2, 8) for _ in range(3)), _caches((5, 5, 5)), meta)
    assert run.num_replayed == 2
    alive = weakref.ref(layers[1].w)
    del run, layers
    gc.collect()
    assert alive() is None
