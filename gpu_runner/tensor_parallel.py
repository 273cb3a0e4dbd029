"""One runner rank of a tensor-parallel group: torch.distributed over a TCP store (gloo on cpu,
NCCL on cuda, each rank on a GPU of its host) and the three collectives the decoder needs.

Every rank runs every step on the same inputs; after an all-reduce or an all-gather every rank
holds the same bits, so the replicated parts of the model (norms, RoPE, the sampler) compute the
same values everywhere and the sampled ids on each rank's device agree without a broadcast.
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from gapless.common.config import EngineConfig

log = logging.getLogger("gapless.gpu_runner")

_LOOPBACK = ("127.0.0.1", "localhost", "::1")
# one collective into one tensor (torch 2.13 renamed it)
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class TensorParallel:
    """This process's place in the group: rank, size, and the collectives over it."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of x over the ranks, in place; x: [T, hidden] partial sums of a row split."""
        dist.all_reduce(x)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """[B, size * n]: every rank's x [B, n] joined along the last dimension, rank order."""
        out = x.new_empty((self.size * x.shape[0], x.shape[1]))  # [size * B, n], rank-major
        _all_gather(out, x.contiguous())
        return out.view(self.size, *x.shape).movedim(0, 1).reshape(x.shape[0], -1)

    def min(self, value: int, device: torch.device) -> int:
        """The least of every rank's value (the KV blocks every rank can hold)."""
        t = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())


def init_tensor_parallel(config: EngineConfig, rank: int) -> TensorParallel | None:
    """Join the group of config.tensor_parallel_size ranks (None for one rank): rank 0 serves
    the TCP store at master_addr:master_port; a rank that does not join within
    --dist-timeout ends the others' wait with an error."""
    size = config.tensor_parallel_size
    if size == 1:
        return None
    if config.master_addr in _LOOPBACK:
        # why: gloo otherwise binds the address the host name resolves to, which in a
        # container may be one the other ranks on this host cannot reach
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    backend = "nccl" if config.device == "cuda" else "gloo"
    if config.device == "cuda":
        per_host = size // config.nnodes
        if torch.cuda.device_count() < per_host:
            raise RuntimeError(f"--tensor-parallel-size {size} needs {per_host} GPUs a host, "
                               f"{torch.cuda.device_count()} visible")  # fmt: skip
        torch.cuda.set_device(rank % per_host)
    dist.init_process_group(
        backend,
        init_method=f"tcp://{config.master_addr}:{config.master_port}",
        rank=rank,
        world_size=size,
        timeout=timedelta(seconds=config.dist_timeout_s),
    )
    log.info("tensor parallel: rank %d of %d (%s)", rank, size, backend)
    return TensorParallel(rank, size)


def leave_group() -> None:
    """Leave the group on a clean stop (every rank is stopping, none is in a collective)."""
    if dist.is_initialized():
        dist.destroy_process_group()
