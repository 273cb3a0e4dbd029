"""What a cpu decode step costs with LoRA adapters: B streams spread over 0, 1, 4 or 8 distinct
adapters, against the same streams on a runner without --enable-lora.

python -m gapless.bench.lora_step --batch 32 --adapters 0 1 4 8
python -m gapless.bench.lora_step --batch 32 --rank 16 -- --no-compile

Adapters are random (rank --rank on every projection of every layer, peft's files, made in a
temporary directory), all resident; plans go straight to the cpu backend's step executor as in
`gapless.bench.cpu_step`, whose streams this reuses. Runs of the conditions alternate; the
figure is the median decode step of each run, then the median of the runs. Anything after `--`
is `gapless serve` flags.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from gapless.bench.cpu_step import Streams, runner_config
from gapless.bench.serve_args import split_serve_args
from gapless.gpu_runner.cpu.threads import set_wait_policy

PARTS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(out: Path, arch, rank: int, seed: int) -> None:
    """A random peft adapter of rank `rank` on every projection of arch's layers."""
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    h, i = arch.hidden_size, arch.intermediate_size
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    shapes = {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
              "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}  # fmt: skip
    tensors = {}
    for layer in range(arch.num_layers):
        for part, (n_out, n_in) in shapes.items():
            where = "self_attn" if part in PARTS[:4] else "mlp"
            key = f"base_model.model.model.layers.{layer}.{where}.{part}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, n_in, generator=gen) * 0.02
            tensors[f"{key}.lora_B.weight"] = torch.randn(n_out, rank, generator=gen) * 0.02
    out.mkdir(parents=True)
    save_file(tensors, out / "adapter_model.safetensors")
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": PARTS}
    (out / "adapter_config.json").write_text(json.dumps(config))


class AdapterStreams(Streams):
    """Streams whose slot s runs with names[s % len(names)] (none when names is empty)."""

    def __init__(self, runner, batch: int, prompt: int, max_tokens: int, names: list[str]):
        super().__init__(runner, batch, prompt, max_tokens)
        self.names = names

    def plan(self, new: bool, tokens):
        plan = super().plan(new, tokens)
        for slot in plan.new_slots:
            slot.lora = self.names[slot.slot % len(self.names)] if self.names else ""
        return plan


def median_step(runner, batch: int, prompt: int, steps: int, names: list[str]) -> float:
    """The median decode step (s) of B fresh streams."""
    from gapless.common.messages import StepPlan

    streams = AdapterStreams(runner, batch, prompt, steps, names)
    streams.prefill()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        streams.decode()
        times.append(time.perf_counter() - start)
    free = StepPlan(
        seq=streams.seq + 1, new_slots=[], freed_slots=list(range(batch)), slots=[],
        num_tokens=[], start_pos=[], has_tokens=[], token_ids=[], sample=[],
        num_new_blocks=[], new_blocks=[],
    )  # fmt: skip
    runner.execute(free)
    runner.batch.num_blocks[:] = 0
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    ours, serve_args = split_serve_args(argv)
    p = argparse.ArgumentParser(
        prog="python -m gapless.bench.lora_step", description=__doc__.split("\n")[0]
    )
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt", type=int, default=32, help="prompt tokens per stream")
    p.add_argument("--steps", type=int, default=24, help="decode steps timed per run")
    p.add_argument("--runs", type=int, default=3, help="runs per condition, interleaved")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--adapters", type=int, nargs="+", default=[0, 1, 4, 8],
                   help="distinct adapters among the streams, one condition each")  # fmt: skip
    args = p.parse_args(ours)
    config = runner_config(serve_args, args.batch, args.prompt)
    set_wait_policy(config.cpu_wait)  # as the runner process does, before torch loads
    import msgspec

    from gapless.common.model_files import load_arch
    from gapless.gpu_runner.cpu.backend import CpuBackend

    arch = load_arch(config.model)
    loaded = max(args.adapters)
    with tempfile.TemporaryDirectory() as tmp:
        modules = {}
        for k in range(loaded):
            modules[f"a{k}"] = str(Path(tmp) / f"a{k}")
            write_adapter(Path(modules[f"a{k}"]), arch, args.rank, k)
        base = CpuBackend(config)
        lora_config = msgspec.structs.replace(config, lora_modules=modules, max_loras=loaded)
        lora = CpuBackend(lora_config) if loaded else None
    print(f"--dtype {str(base.dtype).removeprefix('torch.')}, --quantization "
          f"{base.quantization}, {'compiled' if base.compiled else 'eager'} decode, "
          f"--threads {config.threads}, {loaded} adapters of rank {args.rank} loaded; "
          f"load {os.getloadavg()}", flush=True)  # fmt: skip
    conditions = {"no --enable-lora": (base.executor, [])}
    for k in args.adapters:
        if lora is not None:
            conditions[f"{k} adapters"] = (lora.executor, [f"a{j}" for j in range(k)])
    for runner, names in conditions.values():
        median_step(runner, args.batch, args.prompt, 4, names)  # warm-up
    medians: dict[str, list[float]] = {c: [] for c in conditions}
    for _ in range(args.runs):
        for cond, (runner, names) in conditions.items():
            medians[cond].append(median_step(runner, args.batch, args.prompt, args.steps, names))
    first = statistics.median(medians["no --enable-lora"])
    for cond, ms in medians.items():
        step = statistics.median(ms)
        print(f"{cond:>17}: decode step {step * 1e3:8.2f} ms ({', '.join(f'{m * 1e3:.1f}' for m in ms)}), "
              f"{args.batch / step:7.1f} tok/s, {first / step:.2f}x of no --enable-lora")  # fmt: skip
    print(f"load {os.getloadavg()}")


if __name__ == "__main__":
    main()
