"""`python -m gapless.bench.core_overhead`: the core's host time per step (schedule + apply
result) with prefix caching on and off, in one process, on the sim device, at 0% hits.

The real EngineCore drives the sim device in-process (no frontend, detokenizer or sockets
competing for the cores), on distinct prompts named as the frontend names them. Two cores, one
with caching and one without, run side by side in one process and step in turn, so a burst of
other work on the machine lands on both sides of a pair of steps, not on one setting's run.
Both plan the same steps (tests/core/test_prefix_cache.py checks it), so the ratio of their
host times over a run compares the same work; the figure is the median of that ratio over runs.

Times on a shared two-core machine still spread by +-10% a run (`--control` shows how much), so
`--instructions` counts instead: the scheduler alone (schedule + apply, results faked) over the
same run, under valgrind's callgrind, which counts the instructions executed inside one call
(`--toggle-collect`), with Python's hash seed fixed. The count is the same to a few hundred
instructions from run to run and does not care what else the machine runs; it weighs every
instruction alike, so cache misses are not in it (the timed runs are).
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from collections import deque

import numpy as np
from tqdm import tqdm

from gapless.common.block_hash import chain_hashes, hash_root
from gapless.common.config import EngineConfig
from gapless.common.messages import AddRequest, SamplingParams, StepResult
from gapless.common.model_files import resolve_model
from gapless.core.engine import EngineCore
from gapless.gpu_runner.backend import make_backend


def engine_core(
    config: EngineConfig, prompts: list[list[int]], max_tokens: int, kv_blocks: int
) -> EngineCore:
    """An engine core of kv_blocks blocks holding the run's requests, named as the frontend
    names them."""
    core = EngineCore(config, kv_blocks)
    root = hash_root(config.model.path, "")
    for i, p in enumerate(prompts):
        hashes = chain_hashes(root, p, config.block_size) if config.prefix_caching else []
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        core.handle(AddRequest(f"r{i}", 0, p, params, time.time(), block_hashes=hashes))
    return core


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
        kv_blocks = kv_blocks or self.backend.num_blocks
        self.core = engine_core(config, prompts, max_tokens, kv_blocks)
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


def paired_run(configs: list[EngineConfig], swap: bool, *args) -> list[Run]:
    """Both settings at once, stepping in turn (which goes first alternates every step), so
    whatever else the machine does lands on both sides of each pair of steps alike. `swap`
    builds the second first (alternate it over runs, so neither always comes first)."""
    order = [1, 0] if swap else [0, 1]
    built = {i: Run(configs[i], *args) for i in order}
    runs = [built[0], built[1]]
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
    p.add_argument(
        "--control",
        action="store_true",
        help="both sides without caching: the method's own spread and bias, around 1.000",
    )
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument(
        "--instructions",
        action="store_true",
        help="count the scheduler's instructions over the run under valgrind instead of timing",
    )
    p.add_argument("--count-one", choices=["on", "off"], help=argparse.SUPPRESS)  # valgrind's child
    args = p.parse_args(argv)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 40000, args.prompt_len).tolist() for _ in range(args.requests)]
    base = EngineConfig(
        model=resolve_model(None),
        served_model_name="sim",
        device="sim",
        sim_profile=args.sim_profile,
        sim_time_scale=args.sim_time_scale,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=8192,
    )
    fields = {f: getattr(base, f) for f in base.__struct_fields__}
    if args.instructions:  # the children get the block count: the sim backend imports torch
        kv_blocks = args.kv_blocks or make_backend(base).num_blocks
        count_instructions([*(argv or sys.argv[1:]), "--kv-blocks", str(kv_blocks)])
        return
    if args.count_one:
        config = EngineConfig(**{**fields, "prefix_caching": args.count_one == "on"})
        kv_blocks = args.kv_blocks or make_backend(base).num_blocks
        scheduler_run(config, prompts, args.max_tokens, kv_blocks)
        return
    second = not args.control
    configs = [EngineConfig(**{**fields, "prefix_caching": c}) for c in (False, second)]
    runs: dict[bool, list[dict[str, float]]] = {False: [], True: []}
    ratios = []
    for k in tqdm(range(args.runs), desc="paired runs", unit="run", disable=None):
        off, on = paired_run(configs, k % 2 == 1, prompts, args.max_tokens, args.kv_blocks)
        runs[False].append(off.summary())
        runs[True].append(on.summary())
        ratios.append(sum(on.host_ms()) / sum(off.host_ms()))
    for caching, rs in runs.items():
        mean = statistics.median(r["host_ms_mean"] for r in rs)
        median = statistics.median(r["host_ms_median"] for r in rs)
        print(
            f"caching {'on ' if caching and second else 'off'}: steps {[r['steps'] for r in rs]}, "
            f"prefill tokens {rs[0]['prefill_tokens']}, hit tokens {rs[0]['hit_tokens']}, "
            f"evictions {rs[0]['evictions']}, "
            f"host ms/step mean {mean:.3f} (runs {[round(r['host_ms_mean'], 3) for r in rs]}), "
            f"median {median:.3f} (sim)"
        )
    print(
        f"{'on / off' if second else 'control, off / off'}, host time over a run: median {statistics.median(ratios):.3f} "
        f"(runs {sorted(round(r, 3) for r in ratios)}) (sim)"
    )


def scheduler_run(
    config: EngineConfig, prompts: list[list[int]], max_tokens: int, kv_blocks: int
) -> None:
    """The scheduler alone over the run, results faked (what --instructions counts)."""
    core = engine_core(config, prompts, max_tokens, kv_blocks)
    s = core.scheduler

    def run(*_) -> int:
        steps = 0
        while (step := s.schedule()) is not None:
            s.update_from_output(
                step, StepResult(seq=step.plan.seq, token_ids=[7] * len(step.sampled))
            )
            steps += 1
        return steps

    # why reduce: valgrind --toggle-collect=functools_reduce counts inside this one call
    steps = functools.reduce(run, [0, 0])
    print(f"steps {steps}, hit tokens {s.num_hit_tokens}, evictions {s.blocks.num_evictions}, "
          f"preemptions {s.num_preemptions}")  # fmt: skip


def count_instructions(argv: list[str]) -> None:
    """Both settings' scheduler runs under callgrind, at once (counts do not mind)."""
    if shutil.which("valgrind") is None:
        sys.exit("core_overhead: --instructions needs valgrind (apt-get install valgrind)")
    child = [a for a in argv if a != "--instructions"]
    env = dict(os.environ, PYTHONHASHSEED="0", OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    procs = {
        setting: subprocess.Popen(
            [
                "valgrind",
                "--tool=callgrind",
                "--callgrind-out-file=/dev/null",
                "--toggle-collect=functools_reduce",
                sys.executable,
                "-m",
                "gapless.bench.core_overhead",
                *child,
                "--count-one",
                setting,
            ],  # fmt: skip
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for setting in ("off", "on")
    }
    counts = {}
    for setting, proc in procs.items():
        out, err = proc.communicate()
        found = re.search(r"Collected : (\d+)", err)
        if proc.returncode or found is None:
            sys.exit(f"core_overhead: the {setting} run failed:\n{err[-2000:]}")
        counts[setting] = int(found.group(1))
        print(f"caching {setting:>3}: {out.strip()}, {counts[setting]:,} instructions (scheduler)")
    print(f"on / off, instructions over the run: {counts['on'] / counts['off']:.4f}")


if __name__ == "__main__":
    main()
