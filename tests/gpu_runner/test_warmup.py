"""The warm-up step the cuda device runs before it says ready: its size, and a runner that ran
it answers the core's plans exactly as one that did not (run here on the cpu runner)."""

from __future__ import annotations

import pytest

from gapless.gpu_runner.cpu.backend import CpuBackend
from gapless.gpu_runner.cuda.warmup import run_warmup, warmup_plans, warmup_step
from tests.engine_harness import make_config
from tests.gpu_runner.test_padding import Plans

BS = 16


@pytest.mark.parametrize(
    "args, tokens, entries",
    [
        ((8192, 256, 8192, BS, 10**6), 8192, 256),  # the cuda defaults: 256 prompts of 32
        ((512, 64, 2048, BS, 10**6), 512, 64),
        ((100, 256, 2048, BS, 10**6), 100, 100),  # fewer tokens than seats: one token each
        ((8192, 4, 1024, BS, 10**6), 4096, 4),  # four contexts hold 4096 tokens only
        ((8192, 256, 1000, BS, 10**6), 8192, 256),
        ((8192, 2, 8192, BS, 10**6), 8192, 2),
        ((8192, 256, 8192, BS, 300), 704, 256),  # what 300 free blocks hold
    ],
)
def test_the_largest_step_that_fits(args, tokens, entries):
    max_tokens, max_seqs, max_len, bs, free = args
    step = warmup_step(*args)
    assert (step.num_tokens, len(step.lengths)) == (tokens, entries)
    assert sum(step.lengths) == step.num_tokens and max(step.lengths) - min(step.lengths) <= 1
    assert max(step.lengths) <= max_len and step.num_blocks <= free
    assert step.num_blocks == sum(-(-n // bs) for n in step.lengths)


def test_the_plans_fill_the_step_and_free_it():
    step = warmup_step(512, 64, 2048, BS, 1000)
    run, free = warmup_plans(step, vocab=100, max_logprobs=5)
    assert (run.seq, free.seq) == (1, 2)
    assert sum(run.num_tokens) == len(run.token_ids) == 512 and all(run.sample)
    assert run.new_blocks == list(range(1, step.num_blocks + 1))  # block 0 stays scratch
    assert all(0 <= t < 100 for t in run.token_ids)
    params = run.new_slots[0].params
    assert params.prompt_logprobs == params.logprobs == 5 and params.top_k and params.top_p < 1
    assert free.freed_slots == run.slots and not free.slots


def _tokens(runner, n_decodes=4) -> list[list[int]]:
    plans = Plans(BS)
    prompts = {0: list(range(3, 40)), 1: [11, 12, 13], 2: list(range(100, 120))}
    out = [runner.execute(plans.step(prompts, [])).token_ids]
    for _ in range(n_decodes):
        out.append(runner.execute(plans.step({}, list(prompts))).token_ids)
    return out


def test_a_warmed_up_runner_serves_as_a_fresh_one(tiny_model_dir):
    config = make_config(tiny_model_dir, block_size=BS, max_num_seqs=8, max_num_batched_tokens=64)
    fresh, warmed = CpuBackend(config).executor, CpuBackend(config).executor
    step = warmup_step(64, 8, config.model.max_model_len, BS, warmed.num_blocks - 1)
    run_warmup(warmed, step)
    assert warmed.last_seq == 0 and not warmed.sampler._active.any()
    assert not warmed.prompts.prompt_ids and not warmed.prompts.scored_until.any()
    assert _tokens(warmed) == _tokens(fresh)
