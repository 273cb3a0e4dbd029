"""The floor under a decode step: the model's matmuls alone, on this cpu.

python -m gapless.bench.floor --batch 32 --format bf16
python -m gapless.bench.floor --batch 1 --format int4 fp32 bf16 int8
python -m gapless.bench.floor --batch 1 32 --format fp32 int8-fp32 int4-fp32

Every linear layer of the model (30 layers x qkv, o, gate_up, down, then the output layer),
with the model's shapes (q, k, v and gate, up fused, as the engine holds them) and the module
the engine runs for the format (F.linear for float weights, the int8 / int4 kernels of
--quantization, fbgemm's for w8a8 past one row), one after another on a [batch, in] input: a
step's weight reads and FLOPs with nothing around them. Median of 10 after warm-up.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import TYPE_CHECKING

from gapless.gpu_runner.cpu.threads import set_wait_policy

if TYPE_CHECKING:
    import torch
    from torch import nn

# format -> (--dtype, --quantization)
FORMATS = {
    "fp32": ("float32", "none"),
    "bf16": ("bfloat16", "none"),
    "int8": ("bfloat16", "int8"),
    "int4": ("bfloat16", "int4"),
    # the quantized weights under float32 activations: what --dtype auto serves on a CPU
    # without bfloat16 instructions
    "int8-fp32": ("float32", "int8"),
    "int4-fp32": ("float32", "int4"),
    # int8 x int8 products (fbgemm), rows of more than one; float32 activations around them
    "w8a8": ("float32", "w8a8"),
    # int4 for steps of up to 16 rows, bfloat16 weights above
    "int4-dual": ("bfloat16", "int4-dual"),
}


def linear_layers(model: nn.Module) -> list[nn.Module]:
    """The model's matmul modules in the order a step runs them."""
    from torch import nn

    from gapless.gpu_runner.cpu.quant import DualLinear, Int4Linear, Int8Linear, W8A8Linear

    kinds = (nn.Linear, Int8Linear, Int4Linear, W8A8Linear, DualLinear)
    inner = {id(m.one_row) for m in model.modules() if isinstance(m, W8A8Linear)}
    # a DualLinear runs one of its two layers, by the step's rows
    inner |= {id(c) for m in model.modules() if isinstance(m, DualLinear) for c in m.children()}
    return [m for m in model.modules() if isinstance(m, kinds) and id(m) not in inner]


def in_features(module: nn.Module) -> int:
    from gapless.gpu_runner.cpu.quant import DualLinear, Int4Linear, W8A8Linear

    if isinstance(module, DualLinear):
        return in_features(module.dense)
    if isinstance(module, Int4Linear):
        return module.packed.shape[1] * 2
    if isinstance(module, W8A8Linear):
        return module.in_features
    return module.weight.shape[1]


def weight_bytes(module: nn.Module) -> int:
    """Bytes a matmul module holds: weights, scales and offsets (w8a8: fbgemm's packed copy
    and the one-row layer's, of which a step reads one)."""
    from gapless.gpu_runner.cpu.quant import W8A8Linear

    tensors = [*module.parameters(), *module.buffers()]
    if isinstance(module, W8A8Linear):
        weight, bias = module.packed.unpack()
        tensors += [weight.int_repr(), weight.q_per_channel_scales()]
    return sum(t.numel() * t.element_size() for t in tensors)


def build(arch, fmt: str) -> nn.Module:
    """The model with random weights in the format's layers (speed does not read the values)."""
    import torch

    from gapless.gpu_runner.cpu.quant import quantize_model
    from gapless.gpu_runner.model import CausalLM

    dtype, quant = FORMATS[fmt]
    torch.manual_seed(0)
    model = CausalLM(arch).to(getattr(torch, dtype))
    quantize_model(model, quant, "", arch)
    return model.eval()


def floor_step(model: nn.Module, batch: int, dtype: torch.dtype, repeats: int = 10) -> list[float]:
    """Seconds of each of `repeats` passes over every matmul at `batch` rows, after warm-up."""
    import torch

    torch.set_grad_enabled(False)
    layers = linear_layers(model)
    inputs = {n: torch.randn(batch, n, dtype=dtype) for n in {in_features(m) for m in layers}}

    from gapless.gpu_runner.cpu.quant import W8A8Linear

    def kernel(m: nn.Module):
        if isinstance(m, W8A8Linear) and batch > 1:  # the row scaling fuses, compiled
            return m.matmul
        return m

    calls = [(kernel(m), inputs[in_features(m)]) for m in layers]

    def step() -> None:
        for call, x in calls:
            call(x)

    for _ in range(3):
        step()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return times


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m gapless.bench.floor", description=__doc__)
    p.add_argument("--batch", type=int, nargs="+", default=[32])
    p.add_argument("--format", nargs="+", choices=list(FORMATS), default=["bf16"])
    p.add_argument("--model", help="model whose shapes to use (default: the default model)")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--cpu-wait", choices=["short", "passive", "spin"], default="short")
    args = p.parse_args(argv)
    set_wait_policy(args.cpu_wait)  # as the runner does, before torch loads
    import torch

    from gapless.common.model_files import load_arch, resolve_model

    torch.set_num_threads(args.threads)
    arch = load_arch(resolve_model(args.model))
    for fmt in args.format:
        model = build(arch, fmt)
        nbytes = sum(weight_bytes(m) for m in linear_layers(model))
        for batch in args.batch:
            times = floor_step(model, batch, getattr(torch, FORMATS[fmt][0]))
            step = statistics.median(times)
            print(
                f"{fmt:>9} batch {batch:4d}: matmuls {step * 1e3:8.2f} ms a step "
                f"(median of {len(times)}), {batch / step:8.1f} tok/s, "
                f"{nbytes / 2**20:6.1f} MiB of weights held; load {os.getloadavg()[0]:.1f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
