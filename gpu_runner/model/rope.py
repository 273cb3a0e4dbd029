"""Rotary position embeddings of every kind transformers computes, as cos and sin of a step's
positions: plain, linear, dynamic NTK, YaRN, LongRoPE, llama3, and GGUF's per-frequency
factors. Frequencies are computed as transformers does, in float32, so both rotate alike."""

from __future__ import annotations

import math

import torch

from gapless.common.families.base import ModelArch, rope_attention_factor


def _plain(theta: float, dim: int) -> torch.Tensor:  # [dim // 2] float32
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _llama3(inv: torch.Tensor, s: dict) -> torch.Tensor:
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_ctx = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_ctx / low, inv / factor, inv)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_ctx / high) * ~(wavelen > old_ctx / low)
    return torch.where(medium, smoothed, scaled)


def _yarn(theta: float, dim: int, s: dict, max_position: int) -> torch.Tensor:
    original = s["original_max_position_embeddings"]
    factor = s.get("factor") or max_position / original
    fast, slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def dim_of(rotations: float) -> float:  # the dimension that turns `rotations` times
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(fast), dim_of(slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # why: the ramp divides by their difference
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos = theta ** (torch.arange(0, dim, 2).float() / dim)
    keep = 1 - ramp  # share of each frequency kept as it was (extrapolated)
    return (1.0 / (factor * pos)) * (1 - keep) + (1.0 / pos) * keep


def inv_freqs(arch: ModelArch, theta: float, scaling: dict | None):
    """(inverse frequencies [rot / 2] float32, those past the original context or None,
    the original context length, cos/sin's factor)."""
    dim = arch.rotary_dim or arch.head_dim
    inv = _plain(theta, dim)
    kind = scaling["rope_type"] if scaling else None
    factor = rope_attention_factor(scaling, arch.max_position)
    if kind == "linear":
        return inv / scaling["factor"], None, 0, factor
    if kind == "llama3":
        return _llama3(inv, scaling), None, 0, factor
    if kind == "yarn":
        return _yarn(theta, dim, scaling, arch.max_position), None, 0, factor
    if kind == "factors":
        return inv / torch.tensor(scaling["factors"], dtype=torch.float32), None, 0, factor
    if kind == "longrope":
        shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
        short = 1.0 / (torch.tensor(scaling["short_factor"], dtype=torch.float32) * theta**shape)
        long = 1.0 / (torch.tensor(scaling["long_factor"], dtype=torch.float32) * theta**shape)
        return short, long, scaling["original_max_position_embeddings"], factor
    # dynamic NTK changes nothing below max_position_embeddings, which bounds the context served
    assert kind in (None, "dynamic"), f"rope scaling {kind!r}"
    return inv, None, 0, factor


class Rope:
    """cos and sin of a step's positions for one RoPE; tables on the model's device.

    LongRoPE: a position at or past the original context takes the long factors, one before
    it the short ones, so a sequence's cached keys never change (transformers takes the long
    factors for every token of a forward call whose last position is past it: the same for a
    decode step, and for a prompt shorter than the original context)."""

    def __init__(self, arch: ModelArch, theta: float, scaling: dict | None) -> None:
        self.inv, self.long, self.original, self.factor = inv_freqs(arch, theta, scaling)
        # why: NaN here makes every logit NaN and every completion empty, silently
        tables = [self.inv, torch.tensor(self.factor)] + (
            [self.long] if self.long is not None else []
        )
        # (a model built on the meta device has no values to check: its loader checked the
        # config's numbers before, common/model_check.py)
        if not all(t.is_meta or torch.isfinite(t).all() for t in tables):
            raise ValueError(f"RoPE of base {theta} and scaling {scaling} is not finite")

    def to(self, device: torch.device) -> Rope:
        self.inv = self.inv.to(device)
        self.long = None if self.long is None else self.long.to(device)
        return self

    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pos = positions.float()[:, None]  # [T, 1]
        inv = self.inv[None, :]
        if self.long is not None:
            inv = torch.where(pos >= self.original, self.long[None, :], inv)
        freqs = pos * inv  # [T, rot / 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, rot]
        if self.factor == 1.0:
            return emb.cos(), emb.sin()
        return emb.cos() * self.factor, emb.sin() * self.factor


def rope_inv_freq(arch: ModelArch) -> torch.Tensor:  # [rot / 2] float32
    """The global RoPE's inverse frequencies (those below the original context)."""
    return inv_freqs(arch, arch.rope_theta, arch.rope_scaling)[0]


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [T, heads, d]; cos/sin [T, 1, rot]: the first rot dims turn in Hugging Face's
    # half-split layout, the rest pass through
    rot = cos.shape[-1]
    if rot != x.shape[-1]:
        return torch.cat((rotate(x[..., :rot], cos, sin), x[..., rot:]), dim=-1)
    half = rot // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
