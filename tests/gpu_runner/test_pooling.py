"""Embedding requests through the whole engine (core, runner, detokenizer; in process) against
transformers' final hidden state on the same tiny random weights (float32): last-token, mean
and first-token pooling, chunked prompts, batched and one at a time; no KV kept after them and
nothing hashed into the prefix cache. The sim device's stand-in vector too."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gapless.common.messages import SamplingParams
from tests.conftest import sim_config
from tests.engine_harness import Harness, make_config
from tests.family_models import build
from tests.gpu_runner.test_cuda import gpu

pytest.importorskip("transformers")

PROMPT_LENS = [5, 37, 20]  # 37 > the chunk budget below: pooled across chunks
KINDS = ("last", "mean", "cls")


def pool_of(kind: str, hidden: torch.Tensor) -> np.ndarray:
    """hidden [T, H]: the final hidden state (after the final norm) of one prompt."""
    if kind == "last":
        return hidden[-1].numpy()
    if kind == "cls":
        return hidden[0].numpy()
    return hidden.mean(0).numpy()


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def family(request, tmp_path_factory, tiny_model_dir):
    """(an engine on the model, prompts, transformers' final hidden state of each prompt)."""
    out = tmp_path_factory.mktemp(f"pool-{request.param}")
    ref = build(request.param, out, tiny_model_dir)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 40000, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    with torch.no_grad():
        hidden = [ref.model(torch.tensor([p])).last_hidden_state[0] for p in prompts]
    harness = Harness(make_config(out, max_num_batched_tokens=16, block_size=4))
    return harness, prompts, hidden


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def _vectors(harness: Harness, rids: list[str]) -> list[np.ndarray]:
    out = []
    for rid in rids:
        last = harness.deltas[rid][-1]
        assert last.finish_reason is not None and last.embedding is not None, rid
        out.append(np.frombuffer(last.embedding, dtype="<f4"))
    return out


def _params(kind: str) -> SamplingParams:
    return SamplingParams(max_tokens=1, temperature=0.0, pooling=kind)


def test_pooled_vectors_equal_transformers_batched_and_alone(family):
    """Every kind and prompt in one batch beside a generating request (prompts chunked by a
    budget of 16), then each alone: transformers' vectors both times; nothing kept."""
    harness, prompts, hidden = family
    gen = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    harness.add("gen-alone", prompts[1], gen)
    harness.run()
    harness.add("gen", prompts[1], gen)
    cases = {f"{kind}-{i}": (kind, i) for kind in KINDS for i in range(len(prompts))}
    for rid, (kind, i) in cases.items():
        harness.add(rid, prompts[i], _params(kind))
    harness.run()
    assert harness.outputs["gen"] == harness.outputs["gen-alone"]
    batched = dict(zip(cases, _vectors(harness, list(cases)), strict=True))
    for rid, (kind, i) in cases.items():
        want = pool_of(kind, hidden[i])
        assert batched[rid].shape == want.shape
        assert _cosine(batched[rid], want) >= 0.9999, rid
        np.testing.assert_allclose(batched[rid], want, rtol=1e-3, atol=1e-4)
    s = harness.scheduler
    num_cached = s.blocks.num_cached
    for rid, (kind, i) in cases.items():
        harness.add("alone-" + rid, prompts[i], _params(kind))
        harness.run()
        (alone,) = _vectors(harness, ["alone-" + rid])
        np.testing.assert_allclose(alone, batched[rid], rtol=1e-5, atol=1e-6)
    # the generating requests' blocks are cached; the embeddings' repeats of their prompt
    # found none of them, and offered none of their own
    assert s.num_hit_tokens == (len(prompts[1]) - 1) // 4 * 4  # "gen"'s hit alone
    assert s.blocks.num_cached == num_cached
    assert s.blocks.num_free == s.blocks.num_usable, "KV blocks held after every request ended"


def test_sim_gives_a_deterministic_vector_of_the_hidden_size(default_gguf):
    h = Harness(sim_config(default_gguf, sim_time_scale=0.0))
    h.add("a", list(range(10, 30)), _params("last"))
    h.add("b", list(range(10, 50)), _params("mean"))
    h.add("c", list(range(60, 80)), _params("last"))
    h.run()
    a, b, c = _vectors(h, ["a", "b", "c"])
    assert a.shape == (576,)  # SmolLM2's hidden size
    np.testing.assert_array_equal(a, c)  # sim: seeded by the prompt's length
    assert not np.array_equal(a, b)


@pytest.mark.gpu
@gpu
def test_cuda_pools_as_transformers_does(tmp_path, tiny_model_dir):
    """The cuda path (flashinfer's head size 64, bfloat16): every kind, chunked and batched,
    near transformers' float32 vectors."""
    ref = build("qwen3", tmp_path, tiny_model_dir, hidden_size=256, head_dim=64,
                intermediate_size=256)  # fmt: skip
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 40000, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    with torch.no_grad():
        hidden = [ref.model(torch.tensor([p])).last_hidden_state[0] for p in prompts]
    config = make_config(tmp_path, device="cuda", dtype="bfloat16", block_size=16,
                         max_num_seqs=16, max_num_batched_tokens=16)  # fmt: skip
    harness = Harness(config)
    cases = {f"{kind}-{i}": (kind, i) for kind in KINDS for i in range(len(prompts))}
    for rid, (kind, i) in cases.items():
        harness.add(rid, prompts[i], _params(kind))
    harness.run()
    for rid, vec in zip(cases, _vectors(harness, list(cases)), strict=True):
        kind, i = cases[rid]
        assert _cosine(vec, pool_of(kind, hidden[i])) >= 0.99, rid
