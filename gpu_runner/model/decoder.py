"""The decoder every family is: embeddings, layers of attention and MLP (dense or experts),
the final norm and the output layer, each with the family's options (ModelArch)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from gapless.common.families.base import ModelArch
from gapless.common.shards import vocab_range
from gapless.gpu_runner.attention import AttentionMeta
from gapless.gpu_runner.model.layers import MLP, Attention, RMSNorm
from gapless.gpu_runner.model.moe import MoE
from gapless.gpu_runner.model.projection import StepContext
from gapless.gpu_runner.model.rope import Rope

if TYPE_CHECKING:
    from gapless.gpu_runner.tensor_parallel import TensorParallel

# why fused: one matmul over the concatenated rows reads the same weights in fewer, larger
# calls, faster at one row and at 32 (bench/RESULTS.md, "attention's vector path, fused
# projections, numpy's argmax"). Checkpoints keep the separate Hugging Face names;
# fuse_weights concatenates them on load (Phi-3's are joined already).
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
STACKED = ("gate_up_proj", "down_proj")  # each expert's layers -> mlp.experts.<name> [E, ...]


def _join(parts: list[torch.Tensor]) -> torch.Tensor:
    # rows of a weight [out, in] or of stacked experts' [E, out, in]; a bias [out]
    return torch.cat(parts, dim=-2 if parts[0].dim() > 1 else 0)


def fuse_weights(named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`named` (a state dict) itself, each layer's FUSED parts (weights, biases; stacked
    experts' too) replaced by their rows joined in order, and each expert's layers stacked
    (mlp.experts.J.down_proj.weight -> mlp.experts.down_proj [E, H, I]). In place, so each
    part is freed once joined rather than held to the end."""
    for fused, parts in FUSED.items():
        for suffix in (".weight", ".bias", ""):
            tail = "." + parts[0] + suffix
            for key in [k for k in named if k.endswith(tail)]:
                prefix = key[: -len(tail)]
                names = [f"{prefix}.{part}{suffix}" for part in parts]
                if all(n in named for n in names):
                    named[f"{prefix}.{fused}{suffix}"] = _join([named.pop(n) for n in names])
    for layer in {k.split(".experts.")[0] for k in named if ".experts.0." in k}:
        for name in STACKED:
            j, stack = 0, []
            while f"{layer}.experts.{j}.{name}.weight" in named:
                stack.append(named.pop(f"{layer}.experts.{j}.{name}.weight"))
                j += 1
            if stack:
                named[f"{layer}.experts.{name}"] = torch.stack(stack)
    return named


class DecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch, layer: int, tp: TensorParallel | None = None) -> None:
        super().__init__()
        # tensor parallel: attention and MLP outputs are this rank's partial sums
        self.reduce = tp.all_reduce if tp is not None else None
        eps, offset = arch.rms_norm_eps, arch.norm_offset
        self.self_attn = Attention(arch, layer)
        self.mlp: nn.Module = (
            MoE(arch) if arch.is_moe(layer) else MLP(arch.hidden_size, arch.intermediate_size,
                                                     arch.hidden_act)
        )  # fmt: skip
        self.input_layernorm = RMSNorm(arch.hidden_size, eps, offset)
        # without sandwich norms, the norm before the MLP (Hugging Face's name for it)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, eps, offset)
        self.sandwich = arch.sandwich_norm
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(arch.hidden_size, eps, offset)
            self.post_feedforward_layernorm = RMSNorm(arch.hidden_size, eps, offset)
        # which of the step's RoPE tables: 1 for a sliding layer with a RoPE of its own
        self.rope = 1 if arch.local_rope_theta and arch.window(layer) else 0
        # layers of one kind run the same code on their own weights (compiled.py replays them)
        self.kind = (self.self_attn.window, self.rope, type(self.mlp).__name__)

    def forward(self, x, cos, sin, kv, meta, ctx: StepContext | None = None) -> torch.Tensor:
        # cos, sin [R, T, 1, rot]: the step's RoPE tables
        h = self.self_attn(self.input_layernorm(x), cos[self.rope], sin[self.rope], kv, meta, ctx)
        if self.reduce is not None:
            h = self.reduce(h)
        if not self.sandwich:
            x = x + h
            return x + self._mlp(self.post_attention_layernorm(x), ctx)
        x = x + self.post_attention_layernorm(h)
        h = self._mlp(self.pre_feedforward_layernorm(x), ctx)
        return x + self.post_feedforward_layernorm(h)

    def _mlp(self, x: torch.Tensor, ctx: StepContext | None) -> torch.Tensor:
        h = self.mlp(x) if ctx is None else self.mlp(x, ctx)
        return h if self.reduce is None else self.reduce(h)


class Backbone(nn.Module):
    def __init__(self, arch: ModelArch, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(_vocab_rows(arch, tp), arch.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(arch, i, tp) for i in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, arch.norm_offset)


def _vocab_rows(arch: ModelArch, tp: TensorParallel | None) -> int:
    """Rows of the embedding and output layer: the vocabulary, or a rank's padded share."""
    return arch.vocab_size if tp is None else -(-arch.vocab_size // tp.size)


@functools.cache
def _in_dtype(value: float, dtype: torch.dtype) -> float:
    """value rounded to dtype, as transformers scales Gemma's embeddings."""
    return float(torch.tensor(value, dtype=dtype))


class CausalLM(nn.Module):
    """Parameter names follow Hugging Face's, so a state dict loads as is (fuse_weights joins
    the parts that are one layer here).

    With tensor parallelism (tp), arch is the rank's share (gpu_runner/model/shard.py) and the
    embedding and output layer hold its rows of the vocabulary; the logits come back whole."""

    def __init__(self, arch: ModelArch, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.arch = arch
        self.tp = tp
        self.model = Backbone(arch, tp)
        self.lm_head = nn.Linear(arch.hidden_size, _vocab_rows(arch, tp), bias=False)
        if arch.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.make_ropes()

    def make_ropes(self) -> None:
        """The RoPE tables, on the embeddings' device; float32 whatever the model's dtype."""
        arch = self.arch
        ropes = [Rope(arch, arch.rope_theta, arch.rope_scaling)]
        if arch.local_rope_theta:
            ropes.append(Rope(arch, arch.local_rope_theta, None))
        device = self.model.embed_tokens.weight.device
        self.ropes = [r.to(device) for r in ropes] if device.type != "meta" else ropes

    @property
    def uniform(self) -> bool:
        """Every layer of one kind: one compiled graph serves them all."""
        return len({layer.kind for layer in self.model.layers}) == 1

    def load(self, weights: dict[str, torch.Tensor]) -> None:
        if self.arch.tie_word_embeddings:  # why again: to_empty() gives each module its own tensor
            self.lm_head.weight = self.model.embed_tokens.weight
        missing, unexpected = self.load_state_dict(fuse_weights(weights), strict=False)
        missing = [
            m for m in missing if not (m == "lm_head.weight" and self.arch.tie_word_embeddings)
        ]
        assert not missing and not unexpected, f"weights mismatch: {missing=} {unexpected=}"
        self.make_ropes()  # why: a model made on the meta device holds none yet

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T, hidden]
        if self.tp is None:
            return self.model.embed_tokens(input_ids)
        start, end = vocab_range(self.arch.vocab_size, self.tp.size, self.tp.rank)
        mine = (input_ids >= start) & (input_ids < end)
        x = self.model.embed_tokens(torch.where(mine, input_ids - start, 0))
        return self.tp.all_reduce(x * mine[:, None].to(x.dtype))

    def rope(self, positions: torch.Tensor, dtype: torch.dtype):
        """cos, sin [R, T, 1, rot] of dtype: one table per RoPE (Gemma 3's sliding layers
        have their own)."""
        tables = [rope(positions) for rope in self.ropes]
        cos = torch.stack([c for c, _ in tables])[:, :, None, :]
        sin = torch.stack([s for _, s in tables])[:, :, None, :]
        return cos.to(dtype), sin.to(dtype)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] long
        positions: torch.Tensor,  # [T] long
        kv_cache,  # per layer (K, V), each [R, KVH, d]; or a [layers, 2, R, KVH, d] tensor
        meta: AttentionMeta,
        logit_rows: torch.Tensor,  # [B] long: rows whose next-token logits are wanted
        # (layers, x, cos, sin, kv_cache, meta) -> x: the decoder layers run some other way
        run_layers: Callable | None = None,
        # [K] long: rows whose final hidden state is wanted too (embedding requests' pooling)
        pool_rows: torch.Tensor | None = None,
        # the step's per-token context; a step that has something in it (adapter rows) runs
        # its layers eagerly
        ctx: StepContext | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """[B, vocab] float32 logits; with pool_rows, also [K, hidden] float32: those rows'
        hidden states after the final norm (the state an embedding pools)."""
        x = self.embed(input_ids)
        if self.arch.embed_scale != 1.0:
            x = x * _in_dtype(self.arch.embed_scale, x.dtype)
        cos, sin = self.rope(positions, x.dtype)
        if run_layers is not None and (ctx is None or ctx.adapters is None):
            x = run_layers(self.model.layers, x, cos, sin, kv_cache, meta)
        else:
            for i, layer in enumerate(self.model.layers):
                x = layer(x, cos, sin, kv_cache[i], meta, ctx)
        pooled = None if pool_rows is None else self.model.norm(x.index_select(0, pool_rows))
        x = self.model.norm(x.index_select(0, logit_rows))
        logits = self.lm_head(x).float()
        if self.tp is not None:  # [B, chunk] per rank -> [B, vocab] on every rank
            logits = self.tp.all_gather_last(logits)[:, : self.arch.vocab_size]
        if self.arch.final_softcap:
            cap = self.arch.final_softcap
            logits = torch.tanh(logits / cap) * cap
        return logits if pooled is None else (logits, pooled.float())
