"""top_p on cpu without a sort: the same tokens as the sort-based filter, at a fraction of its cost."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from gapless.common.messages import SamplingParams
from gapless.gpu_runner.cpu.sampling import CPU_SAMPLING
from gapless.gpu_runner.sampling.nucleus import mass_above, nucleus_argmax
from gapless.gpu_runner.sampling.sampler import SamplerState


def cpu_paths(sort_free: bool):
    """The cpu's sampling, with the sort-free or the sorting top_p filter."""
    return dataclasses.replace(CPU_SAMPLING, sort_free_top_p=sort_free)


def params(**overrides: object) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 16, **overrides})  # type: ignore[arg-type]


def run(slot_params: dict[int, SamplingParams], logits: torch.Tensor, pos: int, sort_free: bool):
    """Token ids of one sample() over every slot, with the sort-free or the sorting filter."""
    paths = cpu_paths(sort_free)
    state = SamplerState(len(slot_params), logits.shape[1], "cpu", seed=3, paths=paths)
    for slot, p in slot_params.items():
        state.add(slot, p, 4)
    slots = torch.arange(len(slot_params))
    out = state.sample(logits, slots, torch.full_like(slots, pos), list(slot_params))
    return out.token_ids


def test_mass_above_counts_strictly_more_likely_tokens() -> None:
    probs = torch.tensor([[0.1, 0.4, 0.2, 0.2, 0.1], [0.5, 0.25, 0.25, 0.0, 0.0]])
    got = mass_above(probs, torch.tensor([2, 0]))
    assert torch.allclose(got, torch.tensor([0.4, 0.0]))  # a tie (0.2) is not "more likely"


def test_a_draw_outside_the_nucleus_is_redrawn_among_likelier_tokens() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    ratio = torch.tensor([[0.1, 0.2, 0.3, 0.9]])  # token 3 wins the unfiltered race
    # nucleus at 0.7: tokens 0 and 1 (0.5 before token 1 is < 0.7, 0.8 before token 2 is not)
    assert nucleus_argmax(ratio.clone(), probs, torch.tensor([0.7])).tolist() == [1]
    assert nucleus_argmax(ratio.clone(), probs, torch.tensor([0.9])).tolist() == [2]
    assert nucleus_argmax(ratio.clone(), probs, torch.tensor([1.0])).tolist() == [3]


MIXES = {
    "top_p": lambda s: params(temperature=0.8, top_p=0.9, seed=s),
    "small_top_p": lambda s: params(temperature=1.3, top_p=0.1 + 0.01 * (s % 50), seed=s),
    "with_min_p": lambda s: params(temperature=1.0, top_p=0.8, min_p=0.02 * (s % 5)),
    "mixed": lambda s: [
        params(temperature=0.0),
        params(temperature=0.7, top_k=s % 40 + 1, top_p=0.85),
        params(temperature=1.1, top_p=0.5 + 0.005 * s, seed=s),
        params(temperature=0.9),
        params(temperature=0.9, top_k=20, min_p=0.1, seed=s),
    ][s % 5],
}


@pytest.mark.parametrize("mix", list(MIXES))
def test_sort_free_top_p_picks_the_tokens_of_the_sorting_filter(mix: str) -> None:
    vocab, batch = 3000, 96
    gen = torch.Generator().manual_seed(11)
    # peaked rows (a real model's) and flat ones (where the nucleus holds most of the vocab)
    scale = torch.linspace(0.5, 6.0, batch)[:, None]
    logits = torch.randn(batch, vocab, generator=gen) * scale
    slot_params = {s: MIXES[mix](s) for s in range(batch)}
    differ = 0
    for pos in range(6):
        want = run(slot_params, logits, pos, sort_free=False)
        got = run(slot_params, logits, pos, sort_free=True)
        assert torch.equal(got, want)
        differ += int((want != logits.argmax(-1)).sum())
    assert differ > batch  # real draws, not argmax


def test_sort_free_top_p_matches_the_nucleus_distribution() -> None:
    vocab, num_slots, steps, top_p = 12, 512, 12, 0.75
    logits_row = torch.tensor([2.0, 1.6, 1.5, 1.0, 0.7, 0.5, 0.2, 0.0, -0.3, -1.0, -2.0, 0.1])
    slot_params = {s: params(temperature=1.0, top_p=top_p, seed=50_000 + s) for s in range(512)}
    logits = logits_row.repeat(num_slots, 1)
    draws = torch.cat([run(slot_params, logits, pos, sort_free=True) for pos in range(steps)])
    probs = torch.softmax(logits_row.double(), -1)
    order = probs.argsort(descending=True)
    kept = order[: int(((probs[order].cumsum(0) - probs[order]) < top_p).sum())]
    expected = torch.zeros(vocab, dtype=torch.float64)
    expected[kept] = probs[kept] / probs[kept].sum()
    observed = np.bincount(draws.numpy(), minlength=vocab)
    assert observed[expected.numpy() == 0].sum() == 0, "a token outside the nucleus was drawn"
    want = expected[kept].numpy() * draws.numel()
    chi2 = float(((observed[kept.numpy()] - want) ** 2 / want).sum())
    assert len(kept) == 5  # 4 degrees of freedom
    assert chi2 < 18.47  # chi-square, p = 0.001; seeded, so it cannot flake


# ---------------------------------------------------------------- benchmark


@pytest.mark.parametrize("sort_free", [False, True], ids=["sort", "sort_free"])
@pytest.mark.parametrize("batch", [32, 256])
def test_bench_top_p(benchmark, batch: int, sort_free: bool) -> None:  # type: ignore[no-untyped-def]
    """top_p=0.95 alone over SmolLM2's vocabulary: the old full sort against the new filter."""
    vocab = 49152
    gen = torch.Generator().manual_seed(batch)
    # logits with a real model's spread: a few likely tokens over a long flat tail
    logits = torch.randn(batch, vocab, generator=gen) * 2.5
    slot_params = {s: params(temperature=0.8, top_p=0.95) for s in range(batch)}
    state = SamplerState(batch, vocab, "cpu", paths=cpu_paths(sort_free))
    for slot, p in slot_params.items():
        state.add(slot, p, 4)
    slots = torch.arange(batch)
    positions = torch.full((batch,), 100)
    out = benchmark(state.sample, logits, slots, positions, np.arange(batch))
    assert out.token_ids.shape == (batch,)
