"""What the cuda device gives the step executor to time a step and bring its ids back.

A step is queued whole on the current stream; its marks are CUDA events recorded between its
parts, mapped to the host clock by one event and perf_counter taken together. Its sampled ids
go to pinned host memory on a side stream once the step's last event has passed, closed by an
event: nothing in a launch waits for the device, and collect waits for that event only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from gapless.gpu_runner.sampling.logprobs import SampleOutput

POLL_S = 0.0002  # a guess at the wait left when the ids are not on the host yet


def _timed() -> torch.cuda.Event:
    return torch.cuda.Event(enable_timing=True)


class EventTimeline:
    def __init__(self) -> None:
        self.set_clock()

    def set_clock(self) -> None:
        """Take the event and the host time that map device times to the host clock."""
        torch.cuda.synchronize()
        self._epoch = _timed()
        self._epoch.record()
        self._epoch.synchronize()
        self._epoch_host = time.perf_counter()

    def mark(self) -> torch.cuda.Event:
        event = _timed()
        event.record()
        return event

    def host_time(self, mark: torch.cuda.Event) -> float:
        return self._epoch_host + self._epoch.elapsed_time(mark) / 1e3

    def seconds(self, first: torch.cuda.Event, second: torch.cuda.Event) -> float:
        return first.elapsed_time(second) / 1e3

    def launched(self, start: torch.cuda.Event, returned: float) -> float:
        return returned


@dataclass
class PinnedCopy:
    host: SampleOutput | None  # pinned host tensors, valid once `done` has passed; None: empty
    device: SampleOutput | None  # kept alive until the copies from it are done
    done: torch.cuda.Event  # on the copy stream: the host tensors are filled


class PinnedResults:
    def __init__(self) -> None:
        self.stream = torch.cuda.Stream()

    def start(self, out: SampleOutput | None, after: torch.cuda.Event) -> PinnedCopy:
        done = torch.cuda.Event()
        if out is None:
            done.record()
            return PinnedCopy(None, None, done)
        self.stream.wait_event(after)
        with torch.cuda.stream(self.stream):
            host = SampleOutput(
                _to_host(out.token_ids),
                _to_host(out.logprobs),
                _to_host(out.top_ids),
                _to_host(out.top_logprobs),
            )
            done.record()
        return PinnedCopy(host, out, done)

    def seconds_until_ready(self, copy: PinnedCopy) -> float:
        return 0.0 if copy.done.query() else POLL_S

    def wait(self, copy: PinnedCopy) -> SampleOutput | None:
        copy.done.synchronize()
        copy.device = None
        return copy.host


def _to_host(t: torch.Tensor | None) -> torch.Tensor | None:
    """A pinned copy of t, queued on the current stream."""
    if t is None:
        return None
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return host.copy_(t, non_blocking=True)
