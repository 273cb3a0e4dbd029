from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import gapless.gpu_runner.sampling.sampler as sampler_module
from gapless.common.messages import SamplingParams
from gapless.gpu_runner.cpu.sampling import CPU_SAMPLING
from gapless.gpu_runner.sampling.draws import exponentials, fmix32_, mix64
from gapless.gpu_runner.sampling.sampler import SamplerState, SamplingPaths

CPU = torch.device("cpu")


def params(**overrides: object) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 16, **overrides})  # type: ignore[arg-type]


def make_state(
    slot_params: dict[int, SamplingParams],
    vocab_size: int = 64,
    max_slots: int = 8,
    num_prompt_tokens: int = 4,
    seed: int = 0,
    device: torch.device = CPU,
    paths: SamplingPaths | None = None,
) -> SamplerState:
    """A state as the device's backend makes it (its sampling paths), unless `paths`."""
    if paths is None:
        paths = CPU_SAMPLING if device.type == "cpu" else _cuda_sampling()
    state = SamplerState(max_slots, vocab_size, device, seed=seed, paths=paths)
    for slot, p in slot_params.items():
        state.add(slot, p, num_prompt_tokens)
    return state


def _cuda_sampling() -> SamplingPaths:
    from gapless.gpu_runner.cuda.backend import CUDA_SAMPLING

    return CUDA_SAMPLING


def sample(
    state: SamplerState, logits: torch.Tensor, slots: list[int], positions: list[int] | int
) -> sampler_module.SampleOutput:
    if isinstance(positions, int):
        positions = [positions] * len(slots)
    device = state.device
    return state.sample(
        logits.to(device),
        torch.tensor(slots, device=device),
        torch.tensor(positions, device=device),
        host_slots=slots,
    )


def splitmix64(x: int) -> int:
    mask = (1 << 64) - 1
    z = (x + 0x9E3779B97F4A7C15) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return z ^ (z >> 31)


def test_mix64_wraps_like_unsigned_splitmix64() -> None:
    xs = [0, 1, 2, 12345, -5, 2**62, -(2**63)]
    got = mix64(torch.tensor(xs, dtype=torch.int64)).tolist()
    assert [g & ((1 << 64) - 1) for g in got] == [splitmix64(x & ((1 << 64) - 1)) for x in xs]


def test_exponentials_are_positive_finite_with_unit_mean() -> None:
    keys = mix64(torch.arange(64, dtype=torch.int64))
    q = exponentials(keys, fmix32_(torch.arange(4096, dtype=torch.int32)))
    assert q.shape == (64, 4096) and q.dtype == torch.float32
    assert bool((q > 0).all()) and bool(torch.isfinite(q).all())
    assert abs(q.mean().item() - 1.0) < 0.01 and abs(q.var().item() - 1.0) < 0.03


def test_exponentials_are_never_zero() -> None:
    # 2**24 draws meet every u just below 1 that a float32 difference of logs rounded to q = 0
    # (about 1 in 10**6): a zero q turned a filtered-out token's 0 / 0 into the argmax
    keys = mix64(torch.arange(4, dtype=torch.int64))
    q = exponentials(keys, fmix32_(torch.arange(2**22, dtype=torch.int32)))
    assert float(q.min()) >= 2.0**-24 * 0.99  # -log(1 - 2**-24), the smallest q there is


# ---------------------------------------------------------------- greedy and penalties


@pytest.mark.parametrize(("rows", "vocab"), [(4, 1000), (32, 49152)])
def test_greedy_equals_argmax_and_skips_logprobs(rows: int, vocab: int) -> None:
    """Also at 32 rows of the default model's vocabulary, past the cpu's blocks of rows."""
    state = make_state({s: params(temperature=0.0) for s in range(rows)}, vocab, max_slots=rows)
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(1))
    logits[2, 10] = logits[2, 900] = logits[2].max() + 1.0  # a tie: the first index wins
    logits[-1, :] = -torch.inf
    logits[-1, 7] = 0.0
    slots = [3, 0, 1, 2, *range(4, rows)]
    out = sample(state, logits, slots, 9)
    assert torch.equal(out.token_ids, logits.argmax(-1))
    assert out.token_ids[2].item() == 10 and out.token_ids[-1].item() == 7
    assert out.logprobs is None and out.top_ids.shape == (rows, 0)
    assert out.top_logprobs.shape == (rows, 0)


def recorded_state(penalties: SamplingParams) -> SamplerState:
    """Slot 1: prompt [5, 6, 5] (positions 0-2), output [6, 7, 7] (positions 3-5)."""
    state = make_state({1: penalties, 0: params()}, vocab_size=16, num_prompt_tokens=3)
    slots = torch.tensor([1, 1, 1, 1, 1, 1])
    state.record(slots, torch.arange(6), torch.tensor([5, 6, 5, 6, 7, 7]))
    return state


def test_penalties_change_logits_exactly_as_specified() -> None:
    rep, freq, pres = 1.3, 0.25, 0.5
    state = recorded_state(
        params(repetition_penalty=rep, frequency_penalty=freq, presence_penalty=pres)
    )
    logits = torch.linspace(-2.0, 2.0, 16).repeat(2, 1)
    logits[0, 5] = 1.5
    logits[0, 6] = -1.5
    got = state.penalized_logits(logits, torch.tensor([1, 0]))
    want = logits.clone()
    row = want[0]
    for tok in (5, 6, 7):  # seen in prompt or output: repetition penalty
        row[tok] = row[tok] / rep if row[tok] > 0 else row[tok] * rep
    row[6] -= freq * 1 + pres  # output count 1
    row[7] -= freq * 2 + pres  # output count 2
    assert torch.allclose(got, want, atol=1e-6, rtol=0)
    assert torch.equal(got[1], logits[1])  # slot 0 has no penalties: untouched


def test_recomputed_prefill_counts_output_by_position() -> None:
    p = params(frequency_penalty=1.0, repetition_penalty=2.0)
    incremental = recorded_state(p)
    recomputed = make_state({1: p, 0: params()}, vocab_size=16, num_prompt_tokens=3)
    recomputed.record(  # after preemption: prompt + output arrive as one prefill, out of order
        torch.full((6,), 1), torch.tensor([5, 0, 3, 1, 4, 2]), torch.tensor([7, 5, 6, 6, 7, 5])
    )
    logits = torch.randn(1, 16)
    slots = torch.tensor([1])
    assert torch.equal(
        incremental.penalized_logits(logits, slots), recomputed.penalized_logits(logits, slots)
    )


def test_greedy_with_penalties_is_argmax_of_penalized_logits() -> None:
    state = recorded_state(params(temperature=0.0, repetition_penalty=3.0, presence_penalty=2.0))
    logits = torch.zeros(1, 16)
    logits[0, 7] = 1.0  # the favourite, but already generated twice
    logits[0, 3] = 0.5
    out = sample(state, logits, [1], 6)
    assert out.token_ids.tolist() == [3]
    assert torch.equal(out.token_ids, state.penalized_logits(logits, torch.tensor([1])).argmax(-1))


def test_add_after_remove_resets_counters() -> None:
    p = params(frequency_penalty=1.0, presence_penalty=1.0, repetition_penalty=2.0)
    state = recorded_state(p)
    logits = torch.randn(1, 16)
    assert not torch.equal(state.penalized_logits(logits, torch.tensor([1])), logits)
    state.remove(1)
    state.add(1, p, num_prompt_tokens=3)
    assert torch.equal(state.penalized_logits(logits, torch.tensor([1])), logits)


# ---------------------------------------------------------------- seeded randomness


def test_seeded_tokens_ignore_batch_composition_and_slot() -> None:
    vocab = 50
    logits_row = torch.randn(vocab, generator=torch.Generator().manual_seed(3))
    p = params(seed=1234, temperature=1.5)
    alone = make_state({2: p}, vocab_size=vocab)
    crowded = make_state(
        {0: params(), 1: params(seed=99), 5: p, 3: params(temperature=0.0)}, vocab_size=vocab
    )
    others = torch.randn(3, vocab)
    got_alone, got_crowded = [], []
    for pos in range(10, 60):
        got_alone.append(sample(alone, logits_row[None], [2], pos).token_ids.item())
        batch = torch.cat([others[:2], logits_row[None], others[2:]])
        out = sample(crowded, batch, [1, 0, 5, 3], [7, 8, pos, 9])
        got_crowded.append(out.token_ids[2].item())
    assert got_alone == got_crowded
    assert len(set(got_alone)) > 10  # a real draw, not a constant


def test_different_seeds_and_unseeded_steps_differ() -> None:
    vocab = 1000
    logits = torch.zeros(3, vocab)  # uniform: any two streams should rarely agree
    state = make_state({0: params(seed=1), 1: params(seed=2), 2: params()}, vocab_size=vocab)
    draws = torch.stack([sample(state, logits, [0, 1, 2], pos).token_ids for pos in range(20)])
    assert (draws[:, 0] != draws[:, 1]).sum() >= 18
    assert len(set(draws[:, 2].tolist())) >= 18  # unseeded: fresh randomness every step


def test_sampling_in_cpu_blocks_matches_one_block() -> None:
    vocab, batch = 128, 24
    slot_params = {
        s: params(temperature=0.0)
        if s % 5 == 0
        else params(seed=s if s % 2 else None, top_k=s % 7, top_p=0.9, logprobs=s % 3)
        for s in range(batch)
    }
    logits = torch.randn(batch, vocab)
    slots = list(range(batch))[::-1]
    whole = sample(make_state(slot_params, vocab, batch, seed=7), logits, slots, 5)
    blocks = dataclasses.replace(CPU_SAMPLING, block_elements=5 * vocab)
    blocked = sample(make_state(slot_params, vocab, batch, seed=7, paths=blocks), logits, slots, 5)
    for a, b in zip(whole.__dict__.values(), blocked.__dict__.values(), strict=True):
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


# ---------------------------------------------------------------- distributions and filters


def test_temperature_sampling_matches_softmax() -> None:
    vocab, num_slots, steps, temperature = 8, 512, 16, 0.7
    logits_row = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, 1.5, -1.0, 0.2])
    state = make_state(
        {s: params(seed=10_000 + s, temperature=temperature) for s in range(num_slots)},
        vocab_size=vocab,
        max_slots=num_slots,
    )
    logits = logits_row.repeat(num_slots, 1)
    slots = list(range(num_slots))
    draws = torch.cat([sample(state, logits, slots, pos).token_ids for pos in range(steps)])
    observed = np.bincount(draws.numpy(), minlength=vocab)
    expected = torch.softmax(logits_row / temperature, -1).double().numpy() * draws.numel()
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    assert chi2 < 24.32  # chi-square, 7 degrees of freedom, p = 0.001; seeded, so it cannot flake


def test_draws_at_neighbouring_positions_and_seeds_are_independent() -> None:
    vocab, num_slots, steps = 4, 256, 33
    state = make_state(
        {s: params(seed=s) for s in range(num_slots)}, vocab_size=vocab, max_slots=num_slots
    )
    logits = torch.zeros(num_slots, vocab)
    slots = list(range(num_slots))
    draws = torch.stack([sample(state, logits, slots, pos).token_ids for pos in range(steps)])
    draws = draws.numpy()  # [steps, slots]
    # 9 degrees of freedom, p = 0.001; seeded, so it cannot flake
    for first, second in ((draws[:-1], draws[1:]), (draws[:, :-1], draws[:, 1:])):
        table = np.zeros((vocab, vocab))
        np.add.at(table, (first.ravel(), second.ravel()), 1)
        expected = table.sum(1, keepdims=True) * table.sum(0, keepdims=True) / table.sum()
        assert float(((table - expected) ** 2 / expected).sum()) < 27.88


def allowed_tokens(logits_row: torch.Tensor, p: SamplingParams) -> set[int]:
    """Reference filter in float64: top_k, then top_p on the renormalized rest, then min_p."""
    x = logits_row.double() / p.temperature
    order = torch.argsort(x, descending=True).tolist()
    if p.top_k:
        order = order[: p.top_k]
    probs = torch.softmax(x[order], -1)
    keep, mass = [], 0.0
    for tok, prob in zip(order, probs.tolist(), strict=True):
        if mass >= p.top_p:
            break
        keep.append((tok, prob))
        mass += prob
    top = keep[0][1]
    return {tok for tok, prob in keep if prob >= p.min_p * top}


def allowed_mask(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """allowed_tokens of every row at once, for params without min_p: [B, vocab] bool."""
    x = logits.double() / p.temperature
    vals, order = x.sort(-1, descending=True)
    if p.top_k:
        vals, order = vals[:, : p.top_k], order[:, : p.top_k]
    probs = torch.softmax(vals, -1)
    keep = probs.cumsum(-1) - probs < p.top_p  # the mass before a token is under top_p
    return torch.zeros_like(x, dtype=torch.bool).scatter_(1, order, keep)


@pytest.mark.parametrize(
    "filters",
    [
        {"top_k": 5},
        {"top_p": 0.6},
        {"top_p": 0.6, "top_k": 20},  # nucleus found among the top_k candidates
        {"min_p": 0.2},
        {"top_k": 30, "top_p": 0.9, "min_p": 0.05},
    ],
)
def test_filters_never_pick_excluded_tokens(filters: dict[str, float]) -> None:
    vocab, num_slots = 64, 64
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(num_slots, vocab, generator=gen) * 2.0
    slot_params = {s: params(temperature=0.9, seed=s, **filters) for s in range(num_slots)}
    slot_params[0] = params(temperature=1.0)  # an unfiltered row shares the batch
    state = make_state(slot_params, vocab_size=vocab, max_slots=num_slots)
    slots = list(range(num_slots))
    picked: list[set[int]] = [set() for _ in slots]
    for pos in range(40):
        for row, tok in enumerate(sample(state, logits, slots, pos).token_ids.tolist()):
            picked[row].add(tok)
    for row in range(1, num_slots):
        allowed = allowed_tokens(logits[row], slot_params[row])
        assert picked[row] <= allowed, (row, picked[row] - allowed)
    assert sum(len(p) for p in picked[1:]) > 2 * (num_slots - 1)  # filters left real choices
    assert len(picked[0]) > 8


# ---------------------------------------------------------------- logprobs


def test_logprobs_are_raw_log_softmax_with_sorted_top_lists() -> None:
    vocab = 100
    state = make_state(
        {
            0: params(logprobs=0, temperature=0.5, repetition_penalty=1.5),
            1: params(logprobs=3, temperature=0.0),
            2: params(),
        },
        vocab_size=vocab,
    )
    logits = torch.randn(3, vocab) * 3
    out = sample(state, logits, [0, 1, 2], 4)
    log_softmax = torch.log_softmax(logits, -1)
    assert out.logprobs is not None
    want = log_softmax.gather(1, out.token_ids[:, None]).squeeze(1)
    assert torch.allclose(out.logprobs, want, atol=1e-5)
    assert out.top_ids.shape == (3, 3) and out.top_logprobs.shape == (3, 3)
    assert bool((out.top_logprobs[:, :-1] >= out.top_logprobs[:, 1:]).all())
    top_vals, top_ids = log_softmax.topk(3, -1)
    assert torch.equal(out.top_ids, top_ids)
    assert torch.allclose(out.top_logprobs, top_vals, atol=1e-5)


def test_logprobs_request_is_capped_at_max_logprobs() -> None:
    state = SamplerState(2, 50, CPU, max_logprobs=4, paths=CPU_SAMPLING)
    state.add(0, params(logprobs=10), 1)
    out = sample(state, torch.randn(1, 50), [0], 1)
    assert out.top_ids.shape == (1, 4)


# ---------------------------------------------------------------- device


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu_without_host_sync() -> None:
    cuda = torch.device("cuda")
    slot_params = {
        0: params(temperature=0.0, repetition_penalty=1.2),
        1: params(seed=3, top_k=10, top_p=0.8, logprobs=2),
        2: params(seed=4, top_p=0.9, min_p=0.05, frequency_penalty=0.5),
    }
    logits = torch.randn(3, 256) * 4
    cpu_state = make_state(slot_params, vocab_size=256)
    cuda_state = make_state(slot_params, vocab_size=256, device=cuda)
    slots, positions, tokens = (torch.tensor(v) for v in ([0, 2], [4, 5], [7, 9]))
    cpu_state.record(slots, positions, tokens)
    cuda_state.record(slots.to(cuda), positions.to(cuda), tokens.to(cuda))
    keys = mix64(torch.arange(-8, 8))
    assert torch.equal(mix64(keys.to(cuda)).cpu(), mix64(keys))
    want = sample(cpu_state, logits, [0, 1, 2], 6)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = cuda_state.sample(
            logits.to(cuda, non_blocking=True),
            torch.tensor([0, 1, 2]).to(cuda, non_blocking=True),
            torch.tensor([6, 6, 6]).to(cuda, non_blocking=True),
            host_slots=[0, 1, 2],
        )
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(got.token_ids.cpu(), want.token_ids)


# ---------------------------------------------------------------- benchmark

BENCH_MODES = {
    "greedy": params(temperature=0.0),
    "top_k_top_p": params(temperature=0.8, top_k=50, top_p=0.95),
    "top_p": params(temperature=0.8, top_p=0.95),  # full-vocab sort
}


@pytest.mark.parametrize("mode", list(BENCH_MODES))
@pytest.mark.parametrize("batch", [1, 32, 256])
def test_bench_sample(benchmark, batch: int, mode: str) -> None:  # type: ignore[no-untyped-def]
    vocab = 49152
    state = make_state(
        {s: BENCH_MODES[mode] for s in range(batch)}, vocab_size=vocab, max_slots=batch
    )
    logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(batch))
    slots = torch.arange(batch)
    positions = torch.full((batch,), 100)
    host_slots = np.arange(batch)
    out = benchmark(state.sample, logits, slots, positions, host_slots)
    assert out.token_ids.shape == (batch,)
    p = BENCH_MODES[mode]
    if p.temperature == 0.0:
        assert torch.equal(out.token_ids, logits.argmax(-1))
        return
    allowed = allowed_mask(logits, p)
    assert not allowed.all(), "the filters exclude tokens"
    assert bool(allowed.gather(1, out.token_ids[:, None]).all()), "a filtered-out token was drawn"
    if batch > 1:
        assert not torch.equal(out.token_ids, logits.argmax(-1)), "a real draw, not argmax"
