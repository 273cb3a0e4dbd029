"""`python -m gapless.bench.core_overhead`: the core's host time per step (schedule + apply
result) with prefix caching on and off, in one process, on the sim device, at 0% hits.

The real EngineCore drives the sim device in-process (no frontend, detokenizer or sockets
competing for the cores), on distinct prompts named as the frontend names them; runs alternate
off, on, off, on, ... and the figures are the medians over runs of each run's mean, so the
noise of a shared machine falls on both sides alike. Both settings plan the same steps
(tests/core/test_prefix_cache.py checks it).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import deque

import numpy as np

from gapless.core.common.block_hash import chain_hashes, hash_root
from gapless.core.common.config import EngineConfig
from gapless.core.common.messages import AddRequest, SamplingParams
from gapless.core.common.model_files import resolve_model
from gapless.core.engine import EngineCore
from gapless.gpu_runner.backend import make_backend


def one_run(
    config: EngineConfig, prompts: list[list[int]], max_tokens: int, kv_blocks: int | None = None
) -> dict[str, float]:
    backend = make_backend(config)
    core = EngineCore(config, kv_blocks or backend.num_blocks)
    root = hash_root(config.model.path, "")
    for i, p in enumerate(prompts):
        hashes = chain_hashes(root, p, config.block_size) if config.prefix_caching else []
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        core.handle(AddRequest(f"r{i}", 0, p, params, time.time(), block_hashes=hashes))
    inflight: deque = deque()
    result = None
    while core.has_work or inflight or result is not None:
        out = core.step(result)
        inflight.extend(backend.launch(plan) for plan in out.plans)
        result = backend.collect(inflight.popleft()) if inflight else None
    steps = [s for s in core.timeline.last(1 << 20) if s.num_tokens]
    host = [s.schedule_ms + s.apply_ms for s in steps]
    return {
        "steps": len(steps),
        "host_ms_mean": float(np.mean(host)),
        "host_ms_median": float(np.median(host)),
        "prefill_tokens": sum(s.num_prefill_tokens for s in steps),
        "hit_tokens": core.scheduler.num_hit_tokens,
        "evictions": core.scheduler.blocks.num_evictions,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m gapless.bench.core_overhead", description=__doc__)
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--runs", type=int, default=3, help="runs of each setting, alternating")
    p.add_argument("--sim-profile", default="h100-llama3-8b")
    p.add_argument(
        "--sim-time-scale",
        type=float,
        default=1.0,
        help="scale the modelled step times (shorter runs, so more of them; the host work "
        "per step is the same)",
    )
    p.add_argument(
        "--kv-blocks",
        type=int,
        help="KV blocks the core may use (default: what the profile fits); fewer than the "
        "prompts need makes every allocation evict, as on a server that has run a while",
    )
    args = p.parse_args(argv)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 40000, args.prompt_len).tolist() for _ in range(args.requests)]
    base = EngineConfig(
        model=resolve_model(None),
        served_model_name="sim",
        device="sim",
        sim_profile=args.sim_profile,
        sim_time_scale=args.sim_time_scale,
        max_num_seqs=256,
        max_num_batched_tokens=8192,
    )
    runs: dict[bool, list[dict[str, float]]] = {False: [], True: []}
    for _ in range(args.runs):
        for caching in (False, True):
            config = EngineConfig(**{**{f: getattr(base, f) for f in base.__struct_fields__},
                                     "prefix_caching": caching})  # fmt: skip
            runs[caching].append(one_run(config, prompts, args.max_tokens, args.kv_blocks))
    for caching, rs in runs.items():
        mean = statistics.median(r["host_ms_mean"] for r in rs)
        median = statistics.median(r["host_ms_median"] for r in rs)
        print(
            f"caching {'on ' if caching else 'off'}: steps {[r['steps'] for r in rs]}, "
            f"prefill tokens {rs[0]['prefill_tokens']}, hit tokens {rs[0]['hit_tokens']}, "
            f"evictions {rs[0]['evictions']}, "
            f"host ms/step mean {mean:.3f} (runs {[round(r['host_ms_mean'], 3) for r in rs]}), "
            f"median {median:.3f} (sim)"
        )
    on = statistics.median(r["host_ms_mean"] for r in runs[True])
    off = statistics.median(r["host_ms_mean"] for r in runs[False])
    print(f"on / off, mean host ms per step: {on / off:.3f} (sim)")


if __name__ == "__main__":
    main()
