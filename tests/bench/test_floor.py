"""The floor script times every matmul of a step, in each weight format's own module."""

from __future__ import annotations

import pytest
import torch

from gapless.bench.floor import FORMATS, build, floor_step, linear_layers
from gapless.common.model_files import load_arch, resolve_model
from gapless.gpu_runner.cpu.quant import DualLinear, Int4Linear, Int8Linear, W8A8Linear


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_floor_runs_every_linear_layer_of_the_model(tiny_model_dir, fmt: str) -> None:
    arch = load_arch(resolve_model(str(tiny_model_dir)))
    model = build(arch, fmt)
    layers = linear_layers(model)
    assert len(layers) == 4 * arch.num_layers + 1  # qkv o gate_up down per layer, output
    kinds = {"int8": Int8Linear, "int4": Int4Linear, "w8a8": W8A8Linear, "int4-dual": DualLinear}
    kind = kinds.get(FORMATS[fmt][1], torch.nn.Linear)
    assert all(isinstance(m, kind) for m in layers[:-1])
    times = floor_step(model, 4, getattr(torch, FORMATS[fmt][0]), repeats=3)
    assert len(times) == 3 and all(t > 0 for t in times)
