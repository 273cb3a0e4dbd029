"""`python -m gapless.bench.core_overhead`: the core's host time per step (schedule + apply
result) with prefix caching on and off, in one process, on the sim device, at 0% hits.

The real EngineCore drives the sim device in-process (no frontend, detokenizer or sockets
competing for the cores), on distinct prompts named as the frontend names them. Two cores, one
with caching and one without, run side by side in one process and step in turn, so a burst of
other work on the machine lands on both sides of a pair of steps, not on one setting's run.
Both plan the same steps (tests/core/test_prefix_cache.py checks it), so the ratio of their
host times over a run compares the same work; the figure is the median of that ratio over runs.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import deque

import numpy as np
from tqdm import tqdm

from gapless.core.common.block_hash import chain_hashes, hash_root
from gapless.core.common.config import EngineConfig
from gapless.core.common.messages import AddRequest, SamplingParams
from gapless.core.common.model_files import resolve_model
from gapless.core.engine import EngineCore
from gapless.gpu_runner.backend import make_backend


class Run:
    """One engine core driving its own sim device, a step at a time."""

    def __init__(
        self,
        config: EngineConfig,
        prompts: list[list[int]],
        max_tokens: int,
        kv_blocks: int | None = None,
    ) -> None:
        self.backend = make_backend(config)
        self.core = EngineCore(config, kv_blocks or self.backend.num_blocks)
        root = hash_root(config.model.path, "")
        for i, p in enumerate(prompts):
            hashes = chain_hashes(root, p, config.block_size) if config.prefix_caching else []
            params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
            msg = AddRequest(f"r{i}", 0, p, params, time.time(), block_hashes=hashes)
            self.core.handle(msg)
        self.inflight: deque = deque()
        self.result = None

    @property
    def done(self) -> bool:
        return not (self.core.has_work or self.inflight or self.result is not None)

    def step(self) -> None:
        out = self.core.step(self.result)
        self.inflight.extend(self.backend.launch(plan) for plan in out.plans)
        self.result = self.backend.collect(self.inflight.popleft()) if self.inflight else None

    def host_ms(self) -> list[float]:
        """Schedule + apply per step that fed tokens, in order."""
        steps = self.core.timeline.last(1 << 20)
        return [s.schedule_ms + s.apply_ms for s in steps if s.num_tokens]

    def summary(self) -> dict[str, float]:
        steps = [s for s in self.core.timeline.last(1 << 20) if s.num_tokens]
        host = self.host_ms()
        return {
            "steps": len(steps),
            "host_ms_mean": float(np.mean(host)),
            "host_ms_median": float(np.median(host)),
            "prefill_tokens": sum(s.num_prefill_tokens for s in steps),
            "hit_tokens": self.core.scheduler.num_hit_tokens,
            "evictions": self.core.scheduler.blocks.num_evictions,
        }


def paired_run(configs: list[EngineConfig], *args) -> list[Run]:
    """Both settings at once, stepping in turn (which goes first alternates every step), so
    whatever else the machine does lands on both sides of each pair of steps alike."""
    runs = [Run(c, *args) for c in configs]
    k = 0
    while not all(r.done for r in runs):
        for r in runs if k % 2 == 0 else runs[::-1]:
            if not r.done:
                r.step()
        k += 1
    return runs


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
    fields = {f: getattr(base, f) for f in base.__struct_fields__}
    configs = [EngineConfig(**{**fields, "prefix_caching": c}) for c in (False, True)]
    runs: dict[bool, list[dict[str, float]]] = {False: [], True: []}
    ratios = []
    for _ in tqdm(range(args.runs), desc="paired runs", unit="run", disable=None):
        off, on = paired_run(configs, prompts, args.max_tokens, args.kv_blocks)
        runs[False].append(off.summary())
        runs[True].append(on.summary())
        ratios.append(sum(on.host_ms()) / sum(off.host_ms()))
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
    print(
        f"on / off, host time over a run: median {statistics.median(ratios):.3f} "
        f"(runs {sorted(round(r, 3) for r in ratios)}) (sim)"
    )


if __name__ == "__main__":
    main()
