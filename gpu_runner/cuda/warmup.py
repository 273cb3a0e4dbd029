"""The largest step, run once before the runner reports ready: every prompt-step kernel is built
and run (flashinfer compiles its kernels at first use), and on cuda its memory peak is what
sizes the KV cache.

The step fills --max-num-batched-tokens with prompts over up to --max-num-seqs entries, each
sampling with every option that allocates (top-k, top-p, min-p, penalties, logprobs) and
asking prompt logprobs, whose logits make the widest step. A second plan frees the slots, and
the runner's plan count starts again at 0: the core's first plan is still plan 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gapless.common.messages import NewSlot, SamplingParams, StepPlan


@dataclass(frozen=True)
class WarmupStep:
    num_tokens: int  # prompt tokens in the step
    lengths: list[int]  # each entry's prompt
    block_size: int

    @property
    def num_blocks(self) -> int:
        return sum(self.blocks(n) for n in self.lengths)

    def blocks(self, length: int) -> int:
        return -(-length // self.block_size)


def warmup_step(
    max_tokens: int, max_seqs: int, max_model_len: int, block_size: int, free_blocks: int
) -> WarmupStep:
    """The largest step that fits: max_tokens prompt tokens over at most max_seqs entries,
    none longer than max_model_len, in at most free_blocks KV blocks."""
    tokens = max_tokens
    while True:
        entries = min(max_seqs, tokens)
        entries = max(entries, -(-tokens // max_model_len))  # each prompt fits a context
        if entries > max_seqs:  # even max_seqs full contexts hold fewer tokens
            tokens, entries = max_seqs * max_model_len, max_seqs
        base, extra = divmod(tokens, entries)
        lengths = [base + (i < extra) for i in range(entries)]
        step = WarmupStep(tokens, lengths, block_size)
        if step.num_blocks <= free_blocks or tokens == 1:
            assert step.num_blocks <= free_blocks, "the KV cache holds no warm-up step"
            return step
        tokens = max(1, min(tokens - 1, (free_blocks - entries) * block_size))


# every sampling path that allocates on the device; the seed keeps the warm-up deterministic
WARMUP_PARAMS = dict(temperature=0.8, top_p=0.9, top_k=40, min_p=0.05, seed=0,
                     repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.5,
                     logit_bias=((0, 0.5),), max_tokens=1, ignore_eos=True)  # fmt: skip


def warmup_plans(step: WarmupStep, vocab: int, max_logprobs: int) -> tuple[StepPlan, StepPlan]:
    """The step's plan (seq 1: new slots 0.., blocks 1..) and the plan that frees them (seq 2)."""
    params = SamplingParams(
        **WARMUP_PARAMS, logprobs=max_logprobs, prompt_logprobs=max_logprobs
    )  # fmt: skip
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, vocab, n).tolist() for n in step.lengths]
    slots = list(range(len(prompts)))
    new_blocks = list(range(1, step.num_blocks + 1))  # block 0 is the padding scratch
    run = StepPlan(
        seq=1,
        new_slots=[
            NewSlot(slot=s, params=params, num_prompt_tokens=len(p), prompt_token_ids=p)
            for s, p in zip(slots, prompts, strict=True)
        ],
        freed_slots=[],
        slots=slots,
        num_tokens=[len(p) for p in prompts],
        start_pos=[0] * len(prompts),
        has_tokens=[True] * len(prompts),
        token_ids=[t for p in prompts for t in p],
        sample=[True] * len(prompts),
        num_new_blocks=[step.blocks(len(p)) for p in prompts],
        new_blocks=new_blocks,
    )
    free = StepPlan(
        seq=2, new_slots=[], freed_slots=slots, slots=[], num_tokens=[], start_pos=[],
        has_tokens=[], token_ids=[], sample=[], num_new_blocks=[], new_blocks=[],
    )  # fmt: skip
    return run, free


def run_warmup(runner, step: WarmupStep) -> None:
    """Run the step on `runner` (its launch / collect contract), free its slots, and start
    its plan count again."""
    assert runner.last_seq == 0, "the warm-up runs before any plan"
    run, free = warmup_plans(step, runner.arch.vocab_size, runner.config.max_logprobs)
    runner.collect(runner.launch(run))
    runner.collect(runner.launch(free))
    runner.last_seq = 0
