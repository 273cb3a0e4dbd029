"""`gapless bench spec-cost`: the cpu's step-time table and the drafts per step it leads to.

Builds the cpu runner as `gapless serve --speculative ngram` would (the default model unless
--model; the serve flags after `--`), which measures its step time by tokens at start
(gpu_runner/cpu/calibrate.py), and prints the table and, for each batch of decoding rows, the
k the planner's cost model picks (core/spec_cost.py) at a few acceptance rates. A CPU kind's
line in bench/RESULTS.md comes from here.

    python -m gapless.bench.cli spec-cost --batches 1,4,8,16,32,64 -- --quantization int4
"""

from __future__ import annotations

import argparse
import platform

import numpy as np

from gapless.bench.serve_args import split_serve_args


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: list[str]) -> int:
    from gapless.core.spec_cost import SpecCost
    from gapless.gpu_runner.backend import make_backend
    from gapless.launch.cli import add_serve_args, config_from_args

    argv, serve_args = split_serve_args(argv)
    p = argparse.ArgumentParser(prog="gapless bench spec-cost", description=__doc__)
    p.add_argument("--batches", type=_ints, default=[1, 2, 4, 8, 16, 32, 64])
    p.add_argument("--acceptance", type=lambda s: [float(x) for x in s.split(",")],
                   default=[0.3, 0.5, 0.7, 0.9])  # fmt: skip
    p.add_argument("--k", type=int, default=4, help="--num-speculative-tokens (4)")
    args = p.parse_args(argv)
    serve = argparse.ArgumentParser()
    add_serve_args(serve)
    flags = ["--speculative", "ngram", "--num-speculative-tokens", str(args.k), *serve_args]
    config = config_from_args(serve.parse_args(flags))
    backend = make_backend(config)
    tokens, seconds = backend.step_costs  # type: ignore[attr-defined]
    print(f"cpu: {platform.processor() or platform.machine()}, threads {config.threads}")
    print("step time by tokens fed (ms): " + ", ".join(
        f"{n}: {1e3 * s:.2f}" for n, s in zip(tokens, seconds, strict=True)))  # fmt: skip
    print(f"{'rows':>5} " + " ".join(f"{f'a={a:g}':>6}" for a in args.acceptance))
    for b in args.batches:
        ks = []
        for a in args.acceptance:
            cost = SpecCost(tokens, seconds)
            n = 10_000  # results enough to outweigh the prior
            cost.observe(np.full(1, n), np.full(1, round(a * n)))
            cost.accepted, cost.rejected = a * n, (1 - a) * n
            ks.append(cost.best_k(b, b, 0, args.k))
        print(f"{b:>5} " + " ".join(f"{k:>6}" for k in ks))
    return 0
