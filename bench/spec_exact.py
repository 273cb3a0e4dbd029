"""`gapless bench spec-exact`: speculation's output against speculation off, token for token.

Builds the runner as `gapless serve` would (the default model unless --model; the serve flags
after `--`, --dtype float32 unless given) and drives the real EngineCore in process: --prompts
prompts (seeded, each a random block repeated, then random tokens, so prompt lookup finds
something) of --tokens output tokens each (ignore_eos), all at once. Every method runs greedy
(ngram, suffix, prediction, and draft with each --draft-model), and ngram, suffix and
prediction also at temperature 0.8, seeded per request, each against the run with speculation
off at the same settings, every drafting row verifying k drafts each step (no cost model).
`prediction` is off's output with one token in ten changed. Prints, per run, how many outputs
differ from off's (must be 0), drafted and accepted tokens, and steps; exits 1 where any
output differs.

    python -m gapless.bench.cli spec-exact --draft-model DRAFT_DIR -- --model TARGET_DIR
"""

from __future__ import annotations

import argparse
from collections import deque

import numpy as np

from gapless.bench.serve_args import split_serve_args

METHODS_SAMPLED = ("ngram", "suffix", "prediction")


def prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """n prompts: a block of 16 random ids three times, then 16 more random ids."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        block = rng.integers(3, vocab, 16).tolist()
        out.append(block * 3 + rng.integers(3, vocab, 16).tolist())
    return out


def run_engine(config, requests) -> tuple[dict[str, list[int]], float, float, int]:
    """requests: (id, prompt, params, prediction). Each request's output ids, the drafted and
    accepted tokens, and the steps taken."""
    from prometheus_client import CollectorRegistry

    from gapless.common.messages import AddRequest, TokenBatch
    from gapless.core.engine import EngineCore
    from gapless.core.metrics import CoreMetrics
    from gapless.gpu_runner.backend import make_backend

    backend = make_backend(config)
    registry = CollectorRegistry()
    # why no step-time table: every row then keeps k, so each method's verify runs every step
    # (the cost model would stop drafts where they do not pay, and test nothing there)
    core = EngineCore(config, backend.num_blocks, CoreMetrics(registry=registry))
    outputs: dict[str, list[int]] = {}
    for rid, prompt, params, prediction in requests:
        outputs[rid] = []
        core.handle(AddRequest(request_id=rid, frontend_id=0, prompt_token_ids=prompt,
                               params=params, arrival_time=0.0, prediction=prediction))  # fmt: skip
    inflight: deque = deque()
    result, steps = None, 0
    while inflight or core.has_work or result is not None:
        out = core.step(result)
        inflight.extend(backend.launch(plan) for plan in out.plans)
        for msg in out.detok:
            if isinstance(msg, TokenBatch):
                at = 0
                for rid, n in zip(msg.request_ids, msg.counts, strict=True):
                    outputs[rid] += msg.token_ids[at : at + n]
                    at += n
        result = backend.collect(inflight.popleft()) if inflight else None
        steps += 1
    drafted = accepted = 0.0
    for metric in registry.collect():
        for s in metric.samples:
            if s.name == "gapless_spec_draft_tokens_total":
                drafted += s.value
            elif s.name == "gapless_spec_accepted_tokens_total":
                accepted += s.value
    return outputs, drafted, accepted, steps


def main(argv: list[str]) -> int:
    import msgspec

    from gapless.common.messages import SamplingParams
    from gapless.launch.cli import add_serve_args, config_from_args
    from gapless.launch.speculative_config import check_draft_model

    argv, serve_args = split_serve_args(argv)
    p = argparse.ArgumentParser(prog="gapless bench spec-exact", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--k", type=int, default=4, help="--num-speculative-tokens (4)")
    p.add_argument("--draft-model", action="append", default=[], metavar="PATH",
                   help="a draft model for `draft` (repeatable; default: the model itself)")  # fmt: skip
    args = p.parse_args(argv)
    serve = argparse.ArgumentParser()
    add_serve_args(serve)
    dtype = [] if any(a.startswith("--dtype") for a in serve_args) else ["--dtype", "float32"]
    base = config_from_args(serve.parse_args([*dtype, *serve_args]))
    base = msgspec.structs.replace(base, num_speculative_tokens=args.k,
                                   max_num_seqs=max(base.max_num_seqs, args.prompts))  # fmt: skip
    texts = prompts(args.prompts, base.model.vocab_size)
    drafts = args.draft_model or [base.model.path]
    print(f"model {base.model.path}, --dtype {base.dtype}, {args.prompts} prompts x "
          f"{args.tokens} tokens, k {args.k}")  # fmt: skip
    print(f"{'method':<34} {'temp':>4} {'differ':>6} {'drafted':>8} {'accepted':>8} {'steps':>6}")
    differ_total = 0
    for temp in (0.0, 0.8):

        def params(i: int, temp: float = temp) -> SamplingParams:
            seed = 1000 + i if temp else None
            return SamplingParams(max_tokens=args.tokens, temperature=temp, seed=seed,
                                  ignore_eos=True)  # fmt: skip

        off_cfg = msgspec.structs.replace(base, speculative="off")
        requests = [(str(i), t, params(i), []) for i, t in enumerate(texts)]
        off, _, _, off_steps = run_engine(off_cfg, requests)
        print(f"{'off':<34} {temp:>4} {'-':>6} {'-':>8} {'-':>8} {off_steps:>6}")
        runs: list[tuple[str, object, bool]] = [
            (m, msgspec.structs.replace(base, speculative=m), False) for m in ("ngram", "suffix")
        ]
        runs.append(("prediction", msgspec.structs.replace(base, speculative="off"), True))
        if temp == 0.0:
            for path in drafts:
                cfg = check_draft_model(
                    msgspec.structs.replace(base, speculative="draft", speculative_model=path)
                )
                runs.append((f"draft {path}", cfg, False))
        for name, cfg, predicted in runs:
            reqs = [
                (rid, t, par, _changed(off[rid]) if predicted else [])
                for rid, t, par, _ in requests
            ]
            outputs, drafted, accepted, steps = run_engine(cfg, reqs)
            differ = sum(outputs[rid] != off[rid] for rid in off)
            differ_total += differ
            print(f"{name[-34:]:<34} {temp:>4} {differ:>6} {drafted:>8.0f} {accepted:>8.0f} "
                  f"{steps:>6}")  # fmt: skip
    print(f"outputs that differ from off: {differ_total}")
    return 1 if differ_total else 0


def _changed(ids: list[int]) -> list[int]:
    """ids with every tenth token (the 5th, 15th, ...) replaced by another."""
    return [t + 1 if i % 10 == 4 else t for i, t in enumerate(ids)]
