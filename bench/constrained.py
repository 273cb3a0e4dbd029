"""What one grammar-constrained stream costs the others: 32 unconstrained streams against 31
plus 1 constrained, in one batch, on the in-process engine (EngineCore + the device's backend).

`python -m gapless.bench.constrained [--device cpu] [--runs 3] [--tokens 64]` prints, per run and
as medians: the unconstrained streams' decode tokens/s per stream in each case, their ratio, and
the constrained stream's tokens/s relative to an unconstrained one in the same batch.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import deque

import msgspec

from gapless.common.config import EngineConfig
from gapless.common.grammars import json_grammar
from gapless.common.messages import AddRequest, SamplingParams, TokenBatch
from gapless.common.model_cache import default_model_path
from gapless.common.model_files import load_tokenizer, resolve_model
from gapless.core.engine import EngineCore
from gapless.gpu_runner.backend import make_backend
from gapless.launch.cli import default_threads

# a JSON answer that cannot end before a long string: the constrained stream runs to the budget
LONG_ANSWER = {
    "type": "object",
    "properties": {"story": {"type": "string", "minLength": 2000}},
    "required": ["story"],
    "additionalProperties": False,
}
SAMPLE_MS: list[float] = []  # sample stage of every step recorded, ms
PROMPT = "Tell me a long story about a lighthouse keeper and a storm."


def run_batch(
    core: EngineCore,
    backend,
    prompt: list[int],
    params: list[SamplingParams],
    step_ms: list[float] | None = None,
) -> dict[str, tuple[int, float, float]]:
    """Run the requests to the end: request id -> (tokens, first token time, last token time).
    step_ms collects each full-batch decode step's runner time (prepare + forward + sample)."""
    seen: dict[str, list] = {}
    for i, p in enumerate(params):
        rid = f"r{i}-{time.monotonic_ns()}"
        core.handle(AddRequest(rid, 0, prompt, p, time.time()))
        seen[rid] = [0, 0.0, 0.0, i]
    inflight: deque = deque()
    result = None
    while core.has_work or inflight or result is not None:
        out = core.step(result)
        for plan in out.plans:
            inflight.append(backend.launch(plan))
        now = time.perf_counter()
        for msg in out.detok:
            if isinstance(msg, TokenBatch):
                for rid, n in zip(msg.request_ids, msg.counts, strict=True):
                    entry = seen[rid]
                    if n and not entry[0]:
                        entry[1] = now
                    entry[0] += n
                    if n:
                        entry[2] = now
        result = backend.collect(inflight.popleft()) if inflight else None
        t = result.timing if result is not None else None
        if step_ms is not None and t is not None and len(result.token_ids) == len(params):
            step_ms.append((t.device_end - t.plan_received) * 1e3)
            SAMPLE_MS.append(t.sample_s * 1e3)
    return {f"r{e[3]}": (e[0], e[1], e[2]) for e in seen.values()}


def decode_rate(tokens: int, first: float, last: float) -> float:
    """Tokens per second after the first token (the first waits for the batch's prefill)."""
    return (tokens - 1) / (last - first)


def sample_stage_ms(config: EngineConfig, batch: int, steps: int) -> tuple[float, float]:
    """Median ms of the runner's sampling stage for `batch` greedy rows, all free vs one of them
    constrained (mask fill and apply included), interleaved step by step so load on the machine
    hits both alike. The forward is the same in both cases, so this is all a constrained row
    adds to a step."""
    import numpy as np
    import torch

    from gapless.gpu_runner.cpu.sampling import CPU_SAMPLING
    from gapless.gpu_runner.sampling.grammar import GrammarRows
    from gapless.gpu_runner.sampling.sampler import SamplerState

    info = config.model
    vocab = info.vocab_size
    sampler = SamplerState(batch, vocab, "cpu", paths=CPU_SAMPLING)
    free = SamplingParams(max_tokens=steps + 1, temperature=0.0)
    for slot in range(batch):
        sampler.add(slot, free, 4)
    grammar = GrammarRows(
        load_tokenizer(info).to_str(), vocab, tuple(info.eos_token_ids), batch, torch.device("cpu")
    )
    grammar.add(batch - 1, json_grammar(LONG_ANSWER, strict=True), 4)
    host = np.arange(batch)
    slots = torch.arange(batch)
    gen = torch.Generator().manual_seed(0)
    times: dict[bool, list[float]] = {False: [], True: []}
    for step in range(steps):
        positions = torch.full((batch,), 4 + step)
        logits = torch.randn(batch, vocab, generator=gen)
        for constrained in (False, True):
            x = logits.clone()
            t0 = time.perf_counter()
            if constrained:
                constrain = lambda y, inplace: grammar.apply(y, host, inplace)  # noqa: E731
                out = sampler.sample(x, slots, positions, host, constrain)
                grammar.remember(host, out.token_ids)
            else:
                sampler.sample(x, slots, positions, host)
            times[constrained].append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times[False]), statistics.median(times[True])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--threads", type=int, default=default_threads())
    ap.add_argument(
        "--stage", action="store_true", help="time only the sampling stage (free vs constrained)"
    )
    args = ap.parse_args(argv)
    info = resolve_model(str(default_model_path()))
    config = EngineConfig(
        model=info,
        served_model_name="bench",
        device=args.device,
        dtype=args.dtype,
        threads=args.threads,
        max_num_seqs=args.batch,
        max_num_batched_tokens=2048,
    )
    if args.stage:
        for run in range(args.runs):
            a, b = sample_stage_ms(config, args.batch, args.tokens)
            print(
                f"run {run + 1}: sampling stage of {args.batch} rows {a:.2f} ms free, "
                f"{b:.2f} ms with one constrained (+{b - a:.2f} ms)"
            )
        return
    backend = make_backend(config)
    prompt = load_tokenizer(info).encode(PROMPT, add_special_tokens=False).ids
    free = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    grammar = json_grammar(LONG_ANSWER, strict=True)
    constrained = msgspec.structs.replace(free, grammar=grammar, ignore_eos=False)
    n = args.batch
    core = EngineCore(config, backend.num_blocks)  # one for all runs: plans run in sequence
    run_batch(core, backend, prompt, [free] * 4)  # warm up
    all_free, mixed, ratio_c, steps_a, steps_b = [], [], [], [], []
    for run in range(args.runs):
        sa: list[float] = []
        sb: list[float] = []
        a = run_batch(core, backend, prompt, [free] * n, sa)
        b = run_batch(core, backend, prompt, [free] * (n - 1) + [constrained], sb)
        steps_a.append(statistics.median(sa))
        steps_b.append(statistics.median(sb))
        rate_a = statistics.mean(decode_rate(*a[f"r{i}"]) for i in range(n))
        rate_b = statistics.mean(decode_rate(*b[f"r{i}"]) for i in range(n - 1))
        rate_c = decode_rate(*b[f"r{n - 1}"])
        assert b[f"r{n - 1}"][0] == args.tokens, "the constrained stream ended early"
        all_free.append(rate_a)
        mixed.append(rate_b)
        ratio_c.append(rate_c / rate_b)
        print(
            f"run {run + 1} ({args.device}): {n} free {rate_a:.2f} tok/s/stream; "
            f"{n - 1}+1: free {rate_b:.2f}, constrained {rate_c:.2f} tok/s/stream; median step "
            f"{steps_a[-1]:.1f} vs {steps_b[-1]:.1f} ms"
        )
    ma, mb, mc = (statistics.median(x) for x in (all_free, mixed, ratio_c))
    print(
        f"median of {args.runs} ({args.device}): unconstrained streams at {mb / ma:.3f} of "
        f"{n} unconstrained ({mb:.2f} vs {ma:.2f} tok/s/stream); the constrained stream at "
        f"{mc:.3f} of an unconstrained one; median runner step {statistics.median(steps_a):.1f} "
        f"vs {statistics.median(steps_b):.1f} ms (ratio {statistics.median(steps_a) / statistics.median(steps_b):.3f})"
    )


if __name__ == "__main__":
    main()
