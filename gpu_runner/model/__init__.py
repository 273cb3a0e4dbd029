"""The decoder of every family gapless serves (common/families): shared layers with the
family's options, over a paged KV cache."""

from __future__ import annotations

from gapless.gpu_runner.model.decoder import FUSED, CausalLM, DecoderLayer, fuse_weights
from gapless.gpu_runner.model.rope import Rope, rope_inv_freq, rotate

__all__ = ["FUSED", "CausalLM", "DecoderLayer", "Rope", "fuse_weights", "rope_inv_freq", "rotate"]
