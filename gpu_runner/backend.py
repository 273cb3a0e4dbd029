"""What the runner process needs from a device: launch a plan, then collect its result.

A launch returns as soon as the step is queued on the device (cuda, sim) or done (cpu); the
runner process launches step n+1 before it collects step n, so the device never waits for the
publication of the previous step's ids.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Protocol

from gapless.common.messages import StepPlan, StepResult

if TYPE_CHECKING:  # why: the runner process imports this before torch may load
    from gapless.gpu_runner.batch import PersistentBatch


class Backend(Protocol):
    num_blocks: int  # KV blocks of block_size tokens, block 0 included (reserved)
    batch: PersistentBatch  # the slots and block tables the plans change

    def launch(self, plan: StepPlan) -> Any:
        """Queue one step; plans must come in sequence order."""

    def seconds_until_ready(self, handle: Any) -> float:
        """0 when the step's ids are on the host; otherwise a wait worth taking (may be a guess)."""

    def collect(self, handle: Any) -> StepResult:
        """The step's ids and timeline; blocks until the step is done."""


def make_backend(config, rank: int = 0) -> Backend:
    """The device's backend; with --tensor-parallel-size above 1, tensor-parallel rank `rank`,
    after every rank joined the group (gpu_runner/tensor_parallel.py)."""
    if config.device == "sim":
        from gapless.gpu_runner.sim.backend import SimBackend

        return SimBackend(config)
    from gapless.gpu_runner.tensor_parallel import init_tensor_parallel

    if config.device == "cuda":
        import torch

        if torch.cuda.device_count() == 0:
            where = os.environ.get("CUDA_VISIBLE_DEVICES")
            raise RuntimeError(
                f"replica {config.replica} sees no GPU"
                + (f" (CUDA_VISIBLE_DEVICES={where})" if where is not None else "")
                + f": --data-parallel-size {config.data_parallel_size} × "
                f"--tensor-parallel-size {config.tensor_parallel_size} GPUs are needed"
            )
    tp = init_tensor_parallel(config, rank)
    if config.device == "cpu":
        from gapless.gpu_runner.cpu.backend import CpuBackend

        return CpuBackend(config, tp=tp)
    if config.device == "cuda":
        from gapless.gpu_runner.cuda.backend import CudaBackend

        return CudaBackend(config, tp)
    raise ValueError(f"unknown device {config.device!r}")
