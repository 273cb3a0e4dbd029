"""The compiled cpu decode step: the same greedy tokens as transformers and as the eager step.

Each test pays a compilation (cold in a fresh environment), so they are few; every other test
runs the eager step (--no-compile)."""

from __future__ import annotations

import msgspec
import pytest

from gapless.core.common.messages import SamplingParams
from tests.core.test_engine_greedy import GREEDY, reference  # noqa: F401 (a fixture)
from tests.engine_harness import Harness, make_config

pytestmark = pytest.mark.slow


def _count_compiled_runs(backend) -> list[int]:
    """Sizes of the decode steps that ran through the compiled forward."""
    assert backend.compiled, "the runner did not take the compiled path"
    sizes: list[int] = []
    run = backend.graphs.run
    backend.graphs.run = lambda size, meta: sizes.append(size) or run(size, meta)
    return sizes


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


CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about rivers.",
    "List three prime numbers.",
    "Explain what a compiler does in one sentence.",
    "Hi",
]


def test_compiled_and_eager_fp32_agree_on_the_default_model(default_gguf):
    from gapless.core.common.model_files import load_tokenizer

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
    assert outputs[True] == outputs[False]
    assert "Paris" in tok.decode(outputs[True]["solo"])


def test_a_failed_compile_falls_back_to_eager(tiny_model_dir, reference, monkeypatch, caplog):  # noqa: F811
    from gapless.gpu_runner import compiled

    def no_compiler(prime, sizes):
        raise RuntimeError("InvalidCxxCompiler: No working C++ compiler found")

    monkeypatch.setattr(compiled, "warm_up", no_compiler)
    prompts, want = reference
    h = Harness(make_config(tiny_model_dir, compile=True))
    assert not h.backend.compiled
    assert "running it eagerly" in caplog.text and "InvalidCxxCompiler" in caplog.text
    got = h.run({0: [("r0", prompts[0], GREEDY)]})
    assert got["r0"] == want[0]
