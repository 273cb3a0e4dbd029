"""Paged attention on cuda with flashinfer, planned on the host from the same StepLayout as the
torch path.

Prompt chunks and mixed steps go through one BatchPrefillWithPagedKVCacheWrapper (causal,
each entry's queries aligned to the end of its context). Decode-only steps go through
BatchDecodeWithPagedKVCacheWrapper: one per capture size in CUDA-graph mode, each with its own
fixed index buffers, so a graph replays against whatever the last plan() wrote there. plan()
always runs outside the graphs, once per step.

A sliding window is a plan parameter (window_left: the keys before the query's own), so a
model whose layers slide differently (Gemma: sliding and global layers) has one planned
wrapper per window, and each layer runs the one of its own window; the soft cap and the
softmax scale are the same for every layer and planned in each.
"""

from __future__ import annotations

import importlib

import numpy as np
import torch

from gapless.common.model_files import ModelArch
from gapless.gpu_runner.attention import StepLayout

MISSING = "device cuda needs the [cuda] extra: pip install 'gapless[cuda]'"
WORKSPACE_BYTES = 256 * 2**20


def import_flashinfer():
    try:
        return importlib.import_module("flashinfer")
    except ImportError as e:
        raise RuntimeError(MISSING) from e


class FlashinferMeta:
    """The planned wrappers (one per window) and the cache rows this step writes; shared by
    every layer."""

    def __init__(self, wrappers: dict, slot_mapping: torch.Tensor, block_size: int) -> None:
        self.wrappers = wrappers  # window (0: none) -> its wrapper
        self.slot_mapping = slot_mapping  # [T] long, on device
        self.block_size = block_size

    def attend(self, q, k, v, k_cache, v_cache, window: int = 0, softcap: float = 0.0):
        # softcap: planned in every wrapper (the model's one value)
        k_cache.index_copy_(0, self.slot_mapping, k)
        v_cache.index_copy_(0, self.slot_mapping, v)
        shape = (-1, self.block_size, *k_cache.shape[1:])  # [pages, bs, KVH, d], NHD
        return self.wrappers[window].run(q, (k_cache.view(shape), v_cache.view(shape)))


def window_left(window: int) -> int:
    """flashinfer's window_left: the keys a query sees before its own (-1: all of them)."""
    return window - 1 if window else -1


class FlashinferAttention:
    def __init__(
        self,
        arch: ModelArch,
        block_size: int,
        max_blocks_per_seq: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.flashinfer = import_flashinfer()
        self.arch = arch
        self.block_size = block_size
        self.max_blocks_per_seq = max_blocks_per_seq
        self.dtype = dtype
        self.device = device
        # why one workspace: wrappers run one after another on one stream
        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        # why tensor cores past 4: the decode kernel's per-head loop loses to them on wide groups
        self.tensor_cores = arch.num_heads // arch.num_kv_heads > 4
        self.windows = sorted({arch.window(i) for i in range(arch.num_layers)})
        self.prefill = {
            w: self.flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
            for w in self.windows
        }
        self.decode = {
            w: self.flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_tensor_cores=self.tensor_cores
            )
            for w in self.windows
        }
        self.graph_metas: dict[int, FlashinferMeta] = {}
        self._planned: dict[int, torch.cuda.Event] = {}  # id(wrapper) -> its last plan's copies

    def add_graph_size(self, size: int, slot_mapping: torch.Tensor) -> FlashinferMeta:
        """The fixed metadata a graph of `size` decodes is captured with."""
        i32 = dict(dtype=torch.int32, device=self.device)
        wrappers = {
            w: self.flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace,
                "NHD",
                use_cuda_graph=True,
                use_tensor_cores=self.tensor_cores,
                paged_kv_indptr_buffer=torch.zeros(size + 1, **i32),
                paged_kv_indices_buffer=torch.zeros(size * self.max_blocks_per_seq, **i32),
                paged_kv_last_page_len_buffer=torch.zeros(size, **i32),
            )
            for w in self.windows
        }
        meta = FlashinferMeta(wrappers, slot_mapping, self.block_size)
        self.graph_metas[size] = meta
        return meta

    def build(self, layout: StepLayout, slot_mapping: torch.Tensor) -> FlashinferMeta:
        indptr, indices, last = (torch.from_numpy(a) for a in layout.page_lists())  # host int32
        # why the page list goes up here: plan() copies a host list into a graph's fixed buffer
        # with a blocking copy, which waits for every step still queued on the stream; from
        # pinned memory the copy is queued like the rest (the host allocator keeps the block
        # until the copy has read it)
        indices = indices.pin_memory().to(self.device, non_blocking=True)
        arch, size = self.arch, len(layout.num_tokens)
        # positional in the order both wrappers share across flashinfer versions
        shape = (arch.num_heads, arch.num_kv_heads, arch.head_dim, self.block_size)
        dtypes = dict(q_data_type=self.dtype, kv_data_type=self.dtype, sm_scale=arch.scale,
                      logits_soft_cap=arch.attn_softcap or None)  # fmt: skip
        if layout.is_decode:
            meta = self.graph_metas.get(size) or FlashinferMeta(
                self.decode, slot_mapping, self.block_size
            )
            for window, wrapper in meta.wrappers.items():
                self._before_plan(wrapper)
                wrapper.plan(indptr, indices, last, *shape, pos_encoding_mode="NONE",
                             window_left=window_left(window), **dtypes)  # fmt: skip
                self._after_plan(wrapper)
            return meta
        qo_indptr = np.zeros(size + 1, dtype=np.int32)
        np.cumsum(layout.num_tokens, out=qo_indptr[1:])
        meta = FlashinferMeta(self.prefill, slot_mapping, self.block_size)
        for window, wrapper in meta.wrappers.items():
            self._before_plan(wrapper)
            wrapper.plan(torch.from_numpy(qo_indptr), indptr, indices, last, *shape, causal=True,
                         window_left=window_left(window), **dtypes)  # fmt: skip
            self._after_plan(wrapper)
        return meta

    def _before_plan(self, wrapper) -> None:
        # why: plan() rewrites the wrapper's pinned host buffer, which the previous plan's async
        # copy may not have read yet when the device runs steps behind
        done = self._planned.get(id(wrapper))
        if done is not None and not done.query():
            done.synchronize()

    def _after_plan(self, wrapper) -> None:
        done = self._planned.setdefault(id(wrapper), torch.cuda.Event())
        done.record()
