"""The paged KV cache's tensors and their size in bytes.

Per layer a (K, V) pair, each [num_blocks * block_size, kv_heads, head_dim]: flashinfer's NHD
pages, read as flat token rows by the torch path (gpu_runner/attention.py says how a token finds
its row).
"""

from __future__ import annotations

import torch

from gapless.common.config import EngineConfig, max_useful_blocks
from gapless.common.model_files import ModelArch

KVCache = list[tuple[torch.Tensor, torch.Tensor]]


def kv_block_bytes(arch: ModelArch, block_size: int, dtype: torch.dtype) -> int:
    """K and V of one block of block_size tokens over every layer."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * arch.num_layers * block_size * arch.num_kv_heads * arch.head_dim * elem


def blocks_in(memory: int, arch: ModelArch, config: EngineConfig, dtype: torch.dtype) -> int:
    """Blocks that fit in `memory` bytes, and no more than max_num_seqs full contexts need."""
    fit = memory // kv_block_bytes(arch, config.block_size, dtype)
    cap = max_useful_blocks(config.max_num_seqs, config.model.max_model_len, config.block_size)
    return int(min(fit, cap))


def make_kv_cache(
    arch: ModelArch, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
) -> KVCache:
    """Zeros. why a tensor per layer and kind rather than one: a compiled step mutates its
    inputs in place only when none is a view"""
    rows = num_blocks * block_size
    shape = (rows, arch.num_kv_heads, arch.head_dim)
    return [
        (
            torch.zeros(shape, dtype=dtype, device=device),
            torch.zeros(shape, dtype=dtype, device=device),
        )
        for _ in range(arch.num_layers)
    ]
