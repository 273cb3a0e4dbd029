from __future__ import annotations

import pytest

from gapless.detokenizer.state import DetokenizerState, Outbox
from tests.detokenizer.util import make_batch, make_new

TEXT = "The quick brown fox jumps over the lazy dog, while 東京 sleeps under 🌙 light. " * 8


def _bench_step(benchmark, tokenizer, batch_size: int) -> None:
    """One decode step: batch_size running requests, one new token each."""
    ids = tokenizer.encode(TEXT).ids
    state = DetokenizerState(tokenizer)
    for r in range(batch_size):
        state.add(make_new(f"r{r}", frontend_id=r % 2))
    batches = [
        make_batch([(f"r{r}", [ids[(k + r) % len(ids)]], "") for r in range(batch_size)])
        for k in range(len(ids))
    ]
    steps = iter(batches * 1000)

    def run() -> Outbox:
        out = Outbox()
        state.process(next(steps), out)
        return out

    out = benchmark(run)
    assert state.num_requests == batch_size
    assert sum(len(d) for d in out.deltas.values()) <= batch_size


def test_bench_detok_step_256(benchmark, tokenizer):
    _bench_step(benchmark, tokenizer, 256)


@pytest.mark.parametrize("batch_size", [1, 32])
def test_bench_detok_step(benchmark, tokenizer, batch_size: int):
    _bench_step(benchmark, tokenizer, batch_size)
