"""The seam every projection of the decoder layers goes through, and the step context a layer
reads besides its input.

A projection (q/k/v, o, gate/up, down; a shared expert's too) is made by `projection` and
changed after loading only by `wrap_projections`: quantization swaps one for a quantized layer
(gpu_runner/cpu/quant.py), adapters wrap one with their low-rank term (gpu_runner/lora/). The
layers call a projection through `project`, which hands the step context only to a
projection that reads it and only in a step that has something for it: a step without
adapter rows calls each projection on `x` alone, as it always did.

StepContext holds columns of the step's token table, one entry per token row."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

# the projections' module names, as Hugging Face's checkpoints name their parts' layers
PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


@dataclass
class StepContext:
    """What a layer may read of the step beyond x, per token row."""

    slots: torch.Tensor  # [T] long: each row's slot (the table's TOK_SLOT column)
    # [T] long: each row's adapter in the step's stack (0: the base, no adapter); None where
    # the step has no adapter rows
    adapters: torch.Tensor | None = None
    # the first and last stack entries the step's adapter rows use
    span: tuple[int, int] = (0, 0)
    _masks: dict[int, torch.Tensor] = field(default_factory=dict)

    def lora_mask(self, rank: int) -> torch.Tensor:
        """[T, span * rank] float32: 1 where the column belongs to the row's adapter (each
        entry of the span takes `rank` columns), made once a step for each rank."""
        mask = self._masks.get(rank)
        if mask is None:
            assert self.adapters is not None
            lo, hi = self.span
            owner = torch.arange(lo, hi + 1, device=self.adapters.device).repeat_interleave(rank)
            mask = self._masks[rank] = (self.adapters[:, None] == owner[None, :]).float()
        return mask


def projection(in_features: int, out_features: int, bias: bool) -> nn.Module:
    """A projection of the layers, before weights: y = x W^T (+ b), W [out, in]."""
    return nn.Linear(in_features, out_features, bias=bias)


def project(proj: nn.Module, x: torch.Tensor, ctx: StepContext | None) -> torch.Tensor:
    """proj(x), with the step context for a step that has adapter rows."""
    if ctx is None or ctx.adapters is None:
        return proj(x)
    return proj(x, ctx)


def projections(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """(name, module) of every projection, in the model's order. (A mixture of experts' stacked
    weights, named gate_up_proj and down_proj too, are parameters, not modules.)"""
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in PROJECTIONS:
            yield name, module


def wrap_projections(model: nn.Module, wrap: Callable[[str, nn.Module], nn.Module]) -> None:
    """Replace each projection by wrap(name, projection), in place."""
    for name, module in list(projections(model)):
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, wrap(name, module))
