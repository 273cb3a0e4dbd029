"""Resident adapters on the model: each projection wrapped by a LoraProjection that holds
every resident adapter's pair for it, and the per-slot adapter index the step context reads.

Stack index 0 is the base (no adapter); adapters take 1..max_loras. Adapters read into host
memory (`keep`) become resident when a slot names one (`bind`), in an entry no slot uses: the
core seats requests of at most max_loras adapters at once, so one is always there. A fused projection
(q/k/v, gate/up) holds its parts' pairs side by side: A's rows are the parts' ranks in order
(max_rank each) and B is block-diagonal, so one product serves every part and a part an
adapter leaves out adds zeros. The scale is folded into B. Adapters stay in float32 whatever
the base's dtype or quantization.

A step with adapter rows runs every row through the A of each entry in the span of entries it
uses (one contiguous view, one product), keeps each row's own entry's columns (a mask made once
a step per rank) and adds that times B^T: two products a projection, however many adapters
the step mixes. A step without adapter rows calls the base projections alone.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from gapless.common import families
from gapless.gpu_runner.lora.adapter import Adapter
from gapless.gpu_runner.model.decoder import FUSED
from gapless.gpu_runner.model.projection import StepContext, wrap_projections


class LoraProjection(nn.Module):
    """base(x) plus each row's adapter's low-rank term (none for base rows)."""

    def __init__(self, base: nn.Module, parts: list[tuple[str, int]], in_features: int,
                 stack: int, max_rank: int) -> None:  # fmt: skip
        super().__init__()
        self.base = base
        self.parts = parts  # (part's name suffix, its output rows), in row order
        out = sum(n for _, n in parts)
        rank = max_rank * len(parts)
        self.part_rank = max_rank  # columns of each part in an entry
        self.rank = rank  # columns each stack entry takes
        # entry i's pair is rows i*rank..(i+1)*rank of both, so the entries lo..hi that a step
        # uses are one contiguous view
        self.register_buffer("a", torch.zeros(stack * rank, in_features))  # [S*R, in] float32
        self.register_buffer("b", torch.zeros(stack * rank, out))  # [S*R, out] float32, B^T scaled

    def set(self, index: int, pairs: list) -> None:
        """Stack entry index from each part's LoraWeights (None: the adapter leaves it out)."""
        top = index * self.rank
        a, b = self.a[top : top + self.rank], self.b[top : top + self.rank]
        a.zero_()
        b.zero_()
        row = 0
        for p, ((_, n), w) in enumerate(zip(self.parts, pairs, strict=True)):
            if w is not None:
                r, at = w.a.shape[0], p * self.part_rank
                a[at : at + r] = w.a
                b[at : at + r, row : row + n] = (w.b * w.scale).T
            row += n

    def forward(self, x: torch.Tensor, ctx: StepContext | None = None) -> torch.Tensor:
        y = self.base(x)
        if ctx is None or ctx.adapters is None:
            return y
        lo, hi = ctx.span  # the entries the step uses, contiguous
        cols = slice(lo * self.rank, (hi + 1) * self.rank)
        h = x.float() @ self.a[cols].T  # [T, span * R]: every row through every used entry
        h = h * ctx.lora_mask(self.rank)  # each row keeps its own entry's columns (base: none)
        return y + (h @ self.b[cols]).to(y.dtype)


class LoraStack:
    """The adapters resident on one model, and which one each slot uses."""

    def __init__(self, model: nn.Module, arch, max_loras: int, max_rank: int,
                 max_slots: int) -> None:  # fmt: skip
        self.max_loras = max_loras
        self.host: dict[str, Adapter] = {}  # adapters read, by name: what `bind` may make resident
        self.names: list[str | None] = [None] * (max_loras + 1)  # stack index -> adapter
        self.slot_adapter = np.zeros(max_slots, dtype=np.int64)  # [slots] stack index, 0 base
        self.slot_adapter_t = torch.zeros(max_slots, dtype=torch.long)
        fused = families.family(arch.architecture).fused
        self.layers: dict[str, LoraProjection] = {}  # projection name -> its wrapper

        def wrap(name: str, module: nn.Module) -> nn.Module:
            leaf = name.rsplit(".", 1)[-1]
            prefix = name[: -len(leaf)]
            owner = model.get_submodule(name.rsplit(".", 1)[0])
            if leaf in FUSED and not fused:
                parts = list(zip([prefix + p for p in FUSED[leaf]], owner.sizes, strict=True))
            else:
                parts = [(name, sum(owner.sizes) if leaf in FUSED else arch.hidden_size)]
            layer = LoraProjection(module, parts, _in_features(owner, leaf, arch), max_loras + 1,
                                   max_rank)  # fmt: skip
            self.layers[name] = layer
            return layer

        wrap_projections(model, wrap)

    def index(self, name: str) -> int | None:
        return self.names.index(name) if name in self.names else None

    def keep(self, adapter: Adapter) -> None:
        """adapter is in host memory (replacing one of its name): a slot may name it."""
        self.drop(adapter.name)
        self.host[adapter.name] = adapter

    def drop(self, name: str) -> None:
        """Forget adapter name; slots bound to it keep its entry until they are freed."""
        self.host.pop(name, None)
        index = self.index(name)
        if index is not None:
            self.names[index] = None

    def add(self, adapter: Adapter) -> int:
        """Make adapter resident in an entry no slot uses (an empty one first); its index."""
        assert adapter.name not in self.names, f"adapter {adapter.name} is resident already"
        used = set(self.slot_adapter.tolist())
        free = [i for i in range(1, len(self.names)) if i not in used]
        assert free, f"no adapter entry free for {adapter.name}: the core seats at most max_loras"
        index = min(free, key=lambda i: self.names[i] is not None)
        for layer in self.layers.values():
            layer.set(index, [adapter.modules.get(part) for part, _ in layer.parts])
        self.names[index] = adapter.name
        return index

    def bind(self, slot: int, name: str) -> None:
        """The slot's rows use adapter name ("" : the base) from its next step, made resident
        from host memory if it is not."""
        index = 0 if not name else self.index(name)
        if index is None:
            assert name in self.host, f"adapter {name!r} was never read"
            index = self.add(self.host[name])
        self.slot_adapter[slot] = index
        self.slot_adapter_t[slot] = index

    def context(self, slots: torch.Tensor, plan_slots: list[int]) -> StepContext:
        """The step context of rows whose slots are `slots` ([T] long); plan_slots: the
        step's entries' slots, which tell on the host whether any row has an adapter."""
        used = np.unique(self.slot_adapter[plan_slots]) if plan_slots else ()
        used = [int(i) for i in used if i]
        if not used:
            return StepContext(slots)
        adapters = self.slot_adapter_t.to(slots.device)[slots]  # [T] long
        return StepContext(slots, adapters, span=(used[0], used[-1]))


def _in_features(owner: nn.Module, leaf: str, arch) -> int:
    if leaf == "o_proj":
        return owner.num_heads * owner.head_dim
    if leaf == "down_proj":
        return owner.sizes[0]
    return arch.hidden_size
