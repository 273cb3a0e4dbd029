"""The cpu runner's steps without a server: decode speed of B streams, quiet and contended.

python -m gapless.bench.cpu_step --batch 1 --steps 64
python -m gapless.bench.cpu_step --batch 1 --hogs 2          # quiet, then two `nice -n 19` loops
python -m gapless.bench.cpu_step --batch 32 -- --dtype float32 --threads 1
python -m gapless.bench.cpu_step --batch 32 -- --no-compile    # the eager decode step

Plans go straight to the cpu backend's step executor (no scheduler, no HTTP): B streams prefill
`--prompt` token ids each, then decode `--steps` steps together; the figure is the median decode
step. Anything after `--` is `gapless serve` flags, which build the runner's config as the
server would.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

from gapless.bench.serve_args import split_serve_args
from gapless.common.config import EngineConfig
from gapless.common.messages import NewSlot, SamplingParams, StepPlan
from gapless.gpu_runner.cpu.threads import set_wait_policy

HOG = "while True: pass"


def runner_config(serve_args: list[str], batch: int, prompt: int) -> EngineConfig:
    """The config `gapless serve ARGS` would build, with room for the streams' prompts."""
    import msgspec

    from gapless.launch.cli import add_serve_args, config_from_args

    parser = argparse.ArgumentParser(prog="gapless serve")
    add_serve_args(parser)
    config = config_from_args(parser.parse_args(serve_args))

    tokens = max(config.max_num_batched_tokens, batch * prompt)
    return msgspec.structs.replace(
        config, max_num_seqs=max(batch, config.max_num_seqs), max_num_batched_tokens=tokens
    )


class Streams:
    """B streams on slots 0..B-1 of a step executor, each owning its own KV blocks."""

    def __init__(self, runner, batch: int, prompt: int, max_tokens: int) -> None:
        self.runner = runner
        self.batch = batch
        self.bs = runner.config.block_size
        self.blocks_per_stream = -(-(prompt + max_tokens + 1) // self.bs)
        assert batch * self.blocks_per_stream < runner.num_blocks, "KV cache too small"
        self.length = [0] * batch
        self.owned = [0] * batch
        self.seq = runner.last_seq
        self.prompt = prompt

    def _blocks(self, slot: int, end: int) -> list[int]:
        need = -(-end // self.bs) - self.owned[slot]
        first = 1 + slot * self.blocks_per_stream + self.owned[slot]
        self.owned[slot] += need
        return list(range(first, first + need))

    def plan(self, new: bool, tokens: list[list[int]] | None) -> StepPlan:
        self.seq += 1
        slots = list(range(self.batch))
        n = [len(t) for t in tokens] if tokens else [1] * self.batch
        blocks = [self._blocks(s, self.length[s] + n[s]) for s in slots]
        params = SamplingParams(max_tokens=1 << 20, temperature=0.0, ignore_eos=True)
        plan = StepPlan(
            seq=self.seq,
            new_slots=[NewSlot(slot=s, params=params, num_prompt_tokens=n[s]) for s in slots]
            if new
            else [],
            freed_slots=[],
            slots=slots,
            num_tokens=n,
            start_pos=list(self.length),
            has_tokens=[tokens is not None] * self.batch,
            token_ids=[t for ids in tokens for t in ids] if tokens else [],
            sample=[True] * self.batch,
            num_new_blocks=[len(b) for b in blocks],
            new_blocks=[b for bl in blocks for b in bl],
        )
        for s in slots:
            self.length[s] += n[s]
        return plan

    def prefill(self, prompts: list[list[int]] | None = None) -> list[int]:
        """Every stream's prompt in one step (default: token ids 100.. by stream); the first
        sampled tokens."""
        prompts = prompts or [
            [100 + (s * 7 + i) % 30000 for i in range(self.prompt)] for s in range(self.batch)
        ]
        return self.runner.execute(self.plan(True, prompts)).token_ids

    def decode(self) -> list[int]:
        return self.runner.execute(self.plan(False, None)).token_ids


def decode_steps(
    runner, batch: int, prompt: int, steps: int
) -> tuple[list[float], list[list[int]]]:
    """(seconds of each decode step, tokens of each stream) of B fresh streams."""
    streams = Streams(runner, batch, prompt, steps)
    first = streams.prefill()
    tokens = [[t] for t in first]
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        ids = streams.decode()
        times.append(time.perf_counter() - start)
        for row, t in zip(tokens, ids, strict=True):
            row.append(t)
    free = StepPlan(
        seq=streams.seq + 1, new_slots=[], freed_slots=list(range(batch)), slots=[],
        num_tokens=[], start_pos=[], has_tokens=[], token_ids=[], sample=[],
        num_new_blocks=[], new_blocks=[],
    )  # fmt: skip
    runner.execute(free)
    runner.batch.num_blocks[:] = 0
    return times, tokens


@contextmanager
def hogs(n: int) -> Iterator[None]:
    """n busy loops at the lowest priority, as a background job on the same machine would be."""
    procs = [subprocess.Popen(["nice", "-n", "19", sys.executable, "-c", HOG]) for _ in range(n)]
    try:
        time.sleep(0.5)
        yield
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    ours, serve_args = split_serve_args(argv)
    p = argparse.ArgumentParser(
        prog="python -m gapless.bench.cpu_step", description=__doc__.split("\n")[0]
    )
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens per stream")
    p.add_argument("--steps", type=int, default=64, help="decode steps timed per run")
    p.add_argument("--runs", type=int, default=3, help="runs per condition, interleaved")
    p.add_argument(
        "--hogs", type=int, default=0, help="also time each run with N nice 19 busy loops"
    )
    p.add_argument(
        "--eager-too",
        action="store_true",
        help="also time the eager step (--no-compile) in this process, runs interleaved",
    )
    args = p.parse_args(ours)
    config = runner_config(serve_args, args.batch, args.prompt)
    set_wait_policy(config.cpu_wait)  # as the runner process does, before torch loads
    from gapless.gpu_runner.cpu.backend import CpuBackend

    start = time.perf_counter()
    backend = CpuBackend(config)
    runner = backend.executor
    print(
        f"runner ready in {time.perf_counter() - start:.1f} s (--cpu-wait {config.cpu_wait}, "
        f"--threads {config.threads}, --dtype {str(backend.dtype).removeprefix('torch.')}, "
        f"--quantization {backend.quantization}, "
        f"{'compiled' if backend.compiled else 'eager'} decode); "
        f"load {os.getloadavg()}",
        flush=True,
    )
    runners = {"": runner}
    if args.eager_too:
        import msgspec

        runners = {
            "compiled ": runner,
            "eager ": CpuBackend(msgspec.structs.replace(config, compile=False)).executor,
        }
    for r in runners.values():
        decode_steps(r, args.batch, args.prompt, 4)  # warm-up
    conditions = [
        f"{name}{c}"
        for c in ["quiet"] + ([f"{args.hogs} hogs"] if args.hogs else [])
        for name in runners
    ]
    medians: dict[str, list[float]] = {c: [] for c in conditions}
    for _ in range(args.runs):
        for cond in conditions:
            r = runners[next(n for n in runners if cond.startswith(n))]
            with hogs(args.hogs if not cond.endswith("quiet") else 0):
                times, _ = decode_steps(r, args.batch, args.prompt, args.steps)
            medians[cond].append(statistics.median(times))
    for cond, ms in medians.items():
        step = statistics.median(ms)
        print(
            f"{cond:>17}: decode step {step * 1e3:8.2f} ms median of {args.runs} runs "
            f"({', '.join(f'{m * 1e3:.1f}' for m in ms)}), {args.batch / step:8.1f} tok/s"
        )
    for name in runners:
        quiet = statistics.median(medians[f"{name}quiet"])
        if args.hogs:
            contended = statistics.median(medians[f"{name}{args.hogs} hogs"])
            print(f"{name}contended / quiet decode speed: {quiet / contended:.2f}")
    if args.eager_too:
        ratio = statistics.median(medians["eager quiet"]) / statistics.median(
            medians["compiled quiet"]
        )
        print(f"compiled / eager decode speed (quiet): {ratio:.2f}")
    print(f"load {os.getloadavg()}")


if __name__ == "__main__":
    main()
