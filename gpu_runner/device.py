"""What a device gives the step executor (gpu_runner/executor.py): the pieces where devices differ.

A backend builds these and composes them with the executor: the cpu's (gpu_runner/cpu/backend.py)
run a step on the host, so its timeline is the wall clock and its ids are on the host at once;
cuda's (gpu_runner/cuda/backend.py) queue a step on a stream, time it with events and copy its
ids on a side stream.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from gapless.gpu_runner.attention import Attention
from gapless.gpu_runner.batch import PersistentBatch
from gapless.gpu_runner.sampling.logprobs import SampleOutput
from gapless.gpu_runner.sampling.sampler import SamplingPaths


class Timeline(Protocol):
    """Marks points of a step's device work, in the order the device runs it."""

    def mark(self) -> Any:
        """A point after the work queued so far."""
        ...

    def host_time(self, mark: Any) -> float:
        """When the device reached the mark, on the host's perf_counter clock."""
        ...

    def seconds(self, first: Any, second: Any) -> float:
        """Device seconds between two marks."""
        ...

    def launched(self, start: Any, returned: float) -> float:
        """When the step was handed to the device (StepTiming.launched), given its first mark
        and when the launch returned (perf_counter)."""
        ...


class ResultCopy(Protocol):
    """Brings a step's sampled ids and logprobs to the host."""

    def start(self, out: SampleOutput | None, after: Any) -> Any:
        """Begin the copy of `out` once the device passes the mark `after`; None: an empty
        step (nothing to copy). Returns the copy's handle."""
        ...

    def seconds_until_ready(self, copy: Any) -> float:
        """0 when the copy is done, else a wait worth taking."""
        ...

    def wait(self, copy: Any) -> SampleOutput | None:
        """The host tensors, once the copy is done."""
        ...


class HostClock:
    """The device is the host: a mark is the wall clock when the work before it has run, and
    a step is handed over when its work begins."""

    def mark(self) -> float:
        return time.perf_counter()

    def host_time(self, mark: float) -> float:
        return mark

    def seconds(self, first: float, second: float) -> float:
        return second - first

    def launched(self, start: float, returned: float) -> float:
        return start


class HostResults:
    """The sampled tensors are on the host already."""

    def start(self, out: SampleOutput | None, after: Any) -> SampleOutput | None:
        return out

    def seconds_until_ready(self, copy: SampleOutput | None) -> float:
        return 0.0

    def wait(self, copy: SampleOutput | None) -> SampleOutput | None:
        return copy


@dataclass(frozen=True)
class DeviceParts:
    """A backend's pieces for the step executor."""

    device: torch.device
    batch: PersistentBatch  # its staging says how the step's table reaches the device
    attention: Attention  # plans each step's attention (the torch path, flashinfer)
    timeline: Timeline  # times a step (the wall clock, CUDA events)
    results: ResultCopy  # brings the ids to the host (at once, a side stream)
    sampling: SamplingPaths = SamplingPaths()
    pad: bool = True  # decode-only batches run padded through the graph layer
    # the layers of a padded decode (cpu: compiled); None: the model's own loop
    run_layers: Callable | None = None
    # called with a step's rows before its forward (cpu: how many threads it takes)
    before_forward: Callable[[int], None] | None = None
