"""Paged attention: the step layout every device plans from, and what a device's attention gives
the model (its torch path: gpu_runner/cpu/attention.py; flashinfer: gpu_runner/cuda/).

The KV cache of one layer is [2, num_blocks * block_size, kv_heads, head_dim]: K and V, each a
flat array of token rows, which is flashinfer's NHD page layout viewed as
[num_blocks, block_size, kv_heads, head_dim]. A token at position p of a slot lives at row
block_table[slot, p // bs] * bs + p % bs. Block 0 is never handed to a request; padding
entries write and read there.

A layer may attend through a sliding window (a query sees the `window` keys ending at its
own) and soft-cap its scores (s -> softcap * tanh(s / softcap), before the mask and softmax);
every path takes both. Blocks that fell out of a window stay in the page table, masked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch


@dataclass
class StepLayout:
    """A step's entries as attention sees them, on the host; decode padding included."""

    num_tokens: np.ndarray  # [N] int64 query tokens per entry (dummies: 1)
    ctx_len: np.ndarray  # [N] int64 context length once this step's tokens are in (dummies: 1)
    page_table: np.ndarray  # [N, P] int64 KV block per page; valid below num_pages, dummies: 0
    block_size: int

    @property
    def num_pages(self) -> np.ndarray:  # [N] int64
        return -(-self.ctx_len // self.block_size)

    @property
    def is_decode(self) -> bool:
        return bool((self.num_tokens == 1).all())

    def page_lists(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """flashinfer's CSR page table: indptr [N+1], indices [sum pages], last_page_len [N]."""
        pages = self.num_pages
        indptr = np.zeros(len(pages) + 1, dtype=np.int32)
        np.cumsum(pages, out=indptr[1:])
        used = np.arange(self.page_table.shape[1])[None, :] < pages[:, None]  # [N, P]
        indices = self.page_table[used].astype(np.int32)
        last = (self.ctx_len - (pages - 1) * self.block_size).astype(np.int32)
        return indptr, indices, last


class AttentionMeta(Protocol):
    """Per-step attention state shared by every layer; built by the device's backend."""

    slot_mapping: torch.Tensor  # [T] long: cache row written by each query token

    def attend(
        self, q, k, v, k_cache, v_cache, window: int = 0, softcap: float = 0.0
    ) -> torch.Tensor:
        """q [T, H, d], k/v [T, KVH, d], caches [R, KVH, d] -> [T, H, d]; writes k, v first.
        window: keys each query sees, its own included (0: all); softcap: 0 for none."""
        ...


class Attention(Protocol):
    """A device's paged attention: plans each step's metadata on the host."""

    def build(self, layout: StepLayout, slot_mapping: torch.Tensor) -> AttentionMeta:
        """The step's metadata; slot_mapping [T] long, on device: each token's cache row."""
        ...
