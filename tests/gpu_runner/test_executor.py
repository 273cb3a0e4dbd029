"""The step executor with a device's pieces stood in for: a timeline whose marks are counters and
a copy of the ids that finishes when the test says, as an asynchronous device's would. Steps
launch ahead of their collects, the result's timeline comes from the device's marks, and the
tokens are the cpu backend's."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from gapless.common.model_files import load_arch
from gapless.gpu_runner.batch import batch_for
from gapless.gpu_runner.cpu.attention import TorchAttention
from gapless.gpu_runner.cpu.backend import CpuBackend
from gapless.gpu_runner.cpu.sampling import CPU_SAMPLING
from gapless.gpu_runner.device import DeviceParts
from gapless.gpu_runner.executor import StepExecutor
from gapless.gpu_runner.graph import capture_sizes
from gapless.gpu_runner.model.load import load_model
from tests.engine_harness import make_config
from tests.gpu_runner.test_padding import Plans

BS = 16
CPU = torch.device("cpu")
PROMPTS = {0: list(range(3, 40)), 1: [11, 12, 13], 2: list(range(100, 120))}


class CountingTimeline:
    """Mark i is reached at host time 100 + i; marks are half a second apart on the device."""

    def __init__(self) -> None:
        self.marks = 0

    def mark(self) -> int:
        self.marks += 1
        return self.marks

    def host_time(self, mark: int) -> float:
        return 100.0 + mark

    def seconds(self, first: int, second: int) -> float:
        return 0.5 * (second - first)

    def launched(self, start: int, returned: float) -> float:
        return returned


@dataclass
class Copy:
    out: object
    after: int
    done: bool = False


class HeldResults:
    """A copy that is done only once the test lets it through."""

    def __init__(self) -> None:
        self.copies: list[Copy] = []

    def start(self, out, after: int) -> Copy:
        self.copies.append(Copy(out, after))
        return self.copies[-1]

    def seconds_until_ready(self, copy: Copy) -> float:
        return 0.0 if copy.done else 0.01

    def wait(self, copy: Copy):
        assert copy.done, "collect waited for a copy the device had not finished"
        return copy.out


@pytest.fixture(scope="module")
def config(tiny_model_dir):
    return make_config(tiny_model_dir, block_size=BS, max_num_seqs=4)


def held_executor(config) -> tuple[StepExecutor, HeldResults]:
    arch = load_arch(config.model)
    model = load_model(config.model, arch, CPU, torch.float32).eval()
    batch = batch_for(config, CPU, 64)
    max_context = batch.max_blocks_per_seq * BS
    attn = TorchAttention(capture_sizes(4)[-1], max_context, BS, arch.scale, kernel=False)
    results = HeldResults()
    parts = DeviceParts(CPU, batch, attn, CountingTimeline(), results, CPU_SAMPLING)
    return StepExecutor(config, arch, model, torch.float32, 64, parts), results


def test_steps_launch_ahead_and_publish_the_devices_timeline(config):
    executor, results = held_executor(config)
    plans = Plans(BS)
    first = executor.launch(plans.step(PROMPTS, []))
    second = executor.launch(plans.step({}, list(PROMPTS)))  # before the first is collected
    assert [c.after for c in results.copies] == [3, 6], "each copy follows its step's last mark"
    assert executor.seconds_until_ready(first) > 0
    results.copies[0].done = True
    assert executor.seconds_until_ready(first) == 0 and executor.seconds_until_ready(second) > 0
    r1 = executor.collect(first)
    t = r1.timing
    assert (t.device_start, t.device_end) == (101.0, 103.0)
    assert (t.forward_s, t.sample_s) == (0.5, 0.5)
    assert t.plan_received <= t.launched <= t.published and t.prepare_s >= 0
    results.copies[1].done = True
    r2 = executor.collect(second)
    assert (r2.timing.device_start, r2.timing.device_end) == (104.0, 106.0)

    cpu = CpuBackend(config).executor
    want = Plans(BS)
    assert r1.token_ids == cpu.execute(want.step(PROMPTS, [])).token_ids
    assert r2.token_ids == cpu.execute(want.step({}, list(PROMPTS))).token_ids


def test_an_empty_step_copies_nothing(config):
    executor, results = held_executor(config)
    plans = Plans(BS)
    handle = executor.launch(plans.step({}, []))
    assert results.copies[-1].out is None
    results.copies[-1].done = True
    result = executor.collect(handle)
    assert result.token_ids == [] and result.timing.forward_s == 0.0
