"""`gapless bench spec-host`: the host's time per steady step with drafts on or off, on sim.

The real EngineCore drives the sim device in one process (as `bench core_overhead`), so no
frontend, detokenizer or client competes for the cores: for each number of streams it runs
that many requests of 128:128 at once, several times, and prints the medians of schedule,
apply and the sim runner's prepare over the steps that decode at the full batch. Every figure
is sim.

    python -m gapless.bench.cli spec-host --streams 8,32,256 --runs 3 --speculative ngram
"""

from __future__ import annotations

import argparse

import numpy as np

from gapless.bench.host_floor import positive_ints


def host_ms(speculative: str, k: int, streams: int, runs: int, profile: str) -> np.ndarray:
    """[3] median schedule, apply and prepare ms per steady step, each a median over runs."""
    from gapless.bench.core_overhead import Run
    from gapless.common.config import EngineConfig
    from gapless.common.model_files import resolve_model

    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 40000, 128).tolist() for _ in range(streams)]
    config = EngineConfig(
        model=resolve_model(None),
        served_model_name="sim",
        device="sim",
        sim_profile=profile,
        sim_time_scale=0.01,  # the host's work per step does not depend on the step's length
        max_num_seqs=streams,
        max_num_batched_tokens=8192,
        speculative=speculative,
        num_speculative_tokens=k if speculative != "off" else 0,
    )
    per_run = []
    for _ in range(runs):
        run = Run(config, prompts, 128)
        while not run.done:
            run.step()
        steps = [
            s
            for s in run.core.timeline.last(1 << 20)
            if s.num_tokens and not s.num_prefill_tokens and s.num_seqs == streams
        ]
        per_run.append([np.median([getattr(s, f) or 0.0 for s in steps]) for f in STAGES.values()])
    return np.median(np.asarray(per_run), axis=0)


STAGES = {"schedule": "schedule_ms", "apply": "apply_ms", "prepare": "prepare_ms"}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="gapless bench spec-host", description=__doc__)
    p.add_argument("--streams", type=positive_ints, default=(8, 32, 256))
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--speculative", default="ngram", choices=("ngram", "suffix", "off"))
    p.add_argument("--k", type=int, default=4, help="--num-speculative-tokens (4)")
    p.add_argument("--sim-profile", default="h100-llama3-8b")
    args = p.parse_args(argv)
    if args.runs < 1:
        p.error("--runs must be at least 1")
    print(f"spec-host ({args.sim_profile}, sim): {args.speculative}, k={args.k}, 128:128, "
          f"medians of {args.runs} runs, ms per step decoding at the full batch")  # fmt: skip
    for n in args.streams:
        ms = host_ms(args.speculative, args.k, n, args.runs, args.sim_profile)
        cells = "  ".join(f"{name} {v:.3f}" for name, v in zip(STAGES, ms, strict=True))
        print(f"{n:>5} streams: {cells}  sum {ms.sum():.3f} (sim)")
    return 0
