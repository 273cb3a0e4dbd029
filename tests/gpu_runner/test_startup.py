"""The cuda device's startup stages (gpu_runner/cuda/startup.py) run here on the cpu executor, the
device's memory counters stood in for: the stages and their log, the warm-up leaving the
executor as new, the KV cache sized from the measured peaks (the gpu-marked tests in
test_cuda.py run the same on a GPU)."""

from __future__ import annotations

import functools
import logging

import pytest
import torch

from gapless.common.config import max_useful_blocks
from gapless.gpu_runner.cpu.backend import CpuBackend
from gapless.gpu_runner.cuda import startup
from gapless.gpu_runner.cuda.memory import GIB, plan_memory
from gapless.gpu_runner.executor import StepExecutor
from gapless.gpu_runner.kv_cache import kv_block_bytes
from tests.engine_harness import make_config
from tests.gpu_runner.test_padding import Plans

BS = 16


class FakeDevice:
    """torch.cuda's memory counters: `allocated` bytes held, a peak, the device's free bytes."""

    def __init__(self, total: int, free: int) -> None:
        self.total, self.free = total, free
        self.allocated = self.peak = 0
        self.bump = 0  # bytes the next measured call adds to the peak

    def max_memory_allocated(self) -> int:
        self.peak, bump = self.peak + self.bump, self.bump
        self.bump = 0
        return self.allocated + bump

    def patch(self, monkeypatch) -> None:
        for name, fn in {
            "synchronize": lambda: None,
            "empty_cache": lambda: None,
            "reset_peak_memory_stats": lambda: None,
            "memory_allocated": lambda: self.allocated,
            "max_memory_allocated": self.max_memory_allocated,
            "memory_reserved": lambda: self.allocated,
            "mem_get_info": lambda: (self.free, self.total),
        }.items():
            monkeypatch.setattr(torch.cuda, name, fn)


@pytest.fixture
def runner(tiny_model_dir) -> StepExecutor:
    config = make_config(tiny_model_dir, block_size=BS, max_num_seqs=4, max_num_batched_tokens=64)
    r = CpuBackend(config).executor
    r.attn.windows = [0]  # flashinfer's attention names its windows; the cpu's has one
    r.captured = 0
    r.capture = lambda: setattr(r, "captured", r.captured + 1)
    return r


def test_the_stages_size_the_cache_from_the_measured_peaks(runner, monkeypatch, caplog):
    device = FakeDevice(total=80 * GIB, free=70 * GIB)
    device.allocated = 16 * GIB  # the weights and buffers
    device.patch(monkeypatch)
    peaks = iter([2 * GIB, GIB // 2])  # the largest step, then the largest decode
    real = startup.peak_above
    monkeypatch.setattr(startup, "peak_above", lambda fn: (real(fn), next(peaks))[1])
    built = []
    real_build = runner.attn.build
    runner.attn.build = lambda layout, slots: built.append(layout) or real_build(layout, slots)
    caplog.set_level(logging.INFO, logger="gapless.gpu_runner")
    info = startup.start(runner, runner.capture, since=0.0, free_at_start=71 * GIB)
    # a prompt step and a decode step planned (in two threads), before anything ran
    assert sorted(b.is_decode for b in built[:2]) == [False, True]
    assert runner.captured == 1
    names = [r.getMessage().split(": ", 1)[1].split(" in ")[0] for r in caplog.records
             if r.getMessage().startswith(startup.PREFIX)]  # fmt: skip
    assert names == ["weights loaded", "kernels built", "largest step run", "KV cache sized",
                     "CUDA graphs captured"]  # fmt: skip
    c = runner.config
    cap = max_useful_blocks(c.max_num_seqs, c.model.max_model_len, BS)
    per_block = kv_block_bytes(runner.arch, BS, runner.dtype)
    assert runner.num_blocks == cap  # 72 GiB less 16 + 2 + 0.5 + 1 (outside torch) is plenty
    assert len(runner.kv_cache[0][0]) == cap * BS
    assert info["kv_cache_bytes"] == cap * per_block
    assert info["memory_budget_bytes"] == int(0.9 * 80 * GIB)
    assert info["memory_total_bytes"] == 80 * GIB and info["startup_ms"] > 0
    assert {"load_ms", "kernels_ms", "warmup_ms", "kv_sizing_ms", "graphs_ms"} <= set(info)
    assert runner.last_seq == 0 and not runner.sampler._active.any()
    plans = Plans(BS)  # it serves the core's plans from 1 on
    assert len(runner.execute(plans.step({0: [5, 6, 7]}, [])).token_ids) == 1


def test_a_tight_budget_gives_the_cache_what_is_left(runner, monkeypatch):
    per_block = kv_block_bytes(runner.arch, BS, runner.dtype)
    device = FakeDevice(total=100 * per_block, free=90 * per_block)
    device.allocated = 40 * per_block
    device.patch(monkeypatch)
    peaks = iter([10 * per_block, 0])
    monkeypatch.setattr(startup, "peak_above", lambda fn: (fn(), next(peaks))[1])
    monkeypatch.setattr(startup, "build_kernels", lambda r: None)
    # why no margin: this device is 100 blocks of a tiny model, far under a GiB
    monkeypatch.setattr(startup, "plan_memory", functools.partial(plan_memory, margin=0))
    startup.start(runner, runner.capture, since=0.0, free_at_start=90 * per_block)
    assert runner.num_blocks == 90 - 40 - 10  # 90 % of 100 blocks, less the weights and step
    # a sequence's block table as long as the cache it got, not the 128 of its context
    assert runner.batch.max_blocks_per_seq == runner.attn.max_blocks_per_seq == 40 - 1


def test_kv_cache_memory_keeps_its_size_and_the_warm_up_leaves_no_trace(
    tiny_model_dir, monkeypatch
):
    config = make_config(tiny_model_dir, block_size=BS, max_num_seqs=4, max_num_batched_tokens=64,
                         kv_cache_memory=30 * 2**20)  # fmt: skip
    r = CpuBackend(config).executor
    r.attn.windows = [0]
    blocks = r.num_blocks
    FakeDevice(total=80 * GIB, free=70 * GIB).patch(monkeypatch)
    monkeypatch.setattr(startup, "build_kernels", lambda r: None)
    info = startup.start(r, lambda: None, since=0.0, free_at_start=70 * GIB)
    assert r.num_blocks == blocks and "memory_budget_bytes" not in info
    assert all(not c.any() for kv in r.kv_cache for c in kv)


def test_the_first_allocation_holds_the_warm_up_step(tiny_model_dir):
    config = make_config(tiny_model_dir, block_size=BS, max_num_seqs=4, max_num_batched_tokens=64)
    assert startup.sizes_by_kv(config)
    assert startup.first_blocks(config) == 4 * (64 // 4 // BS) + 1  # 4 prompts of 16, and block 0
