"""--gpu-memory-utilization: the KV cache's share of the device, from measured byte counts."""

from __future__ import annotations

import pytest

from gapless.gpu_runner.cuda.memory import FREE_MARGIN, GIB, kv_cache_blocks, plan_memory
from gapless.launch.supervisor import device_note


def test_the_kv_cache_gets_what_the_others_leave_of_the_budget():
    plan = plan_memory(
        total=80 * GIB, utilization=0.9, static=16 * GIB, peak_step=3 * GIB, graphs=GIB,
        other=GIB // 2, free=63 * GIB,
    )  # fmt: skip
    assert plan.budget == 72 * GIB and not plan.by_free
    assert plan.kv_cache == 72 * GIB - 16 * GIB - 3 * GIB - GIB - GIB // 2
    per_block = 2 * 2**20  # Llama-3-8B: 16 tokens of 128 KiB
    assert kv_cache_blocks(plan, per_block, cap=10**9) == plan.kv_cache // per_block == 26368
    assert kv_cache_blocks(plan, per_block, cap=1000) == 1000  # what max_num_seqs can use
    text = plan.describe(0.9)
    assert "51.50 GiB of a 72.00 GiB budget" in text and "of 80.00 GiB" in text
    assert "other processes" not in text


def test_what_other_processes_hold_is_never_taken():
    # another process holds 60 GiB: 4 GiB free once the weights are in
    plan = plan_memory(
        total=80 * GIB, utilization=0.9, static=16 * GIB, peak_step=GIB, graphs=0, other=0,
        free=4 * GIB,
    )  # fmt: skip
    assert plan.by_free and plan.kv_cache == 4 * GIB - GIB - FREE_MARGIN
    assert "held to the 4.00 GiB free" in plan.describe(0.9)
    assert kv_cache_blocks(plan, 2**20, cap=10**9) == 2048


def test_a_budget_the_others_fill_names_the_flags():
    plan = plan_memory(total=80 * GIB, utilization=0.2, static=15 * GIB, peak_step=2 * GIB,
                       graphs=0, other=0, free=60 * GIB)  # fmt: skip
    assert plan.kv_cache < 0
    with pytest.raises(RuntimeError, match="--gpu-memory-utilization.*--kv-cache-memory"):
        kv_cache_blocks(plan, 2**20, cap=100)
    tight = plan_memory(total=GIB, utilization=1.0, static=GIB - 3 * 2**20, peak_step=0,
                        graphs=0, other=0, free=10 * GIB)  # fmt: skip
    with pytest.raises(RuntimeError, match="no room for the KV cache"):
        kv_cache_blocks(tight, 2 * 2**20, cap=100)  # one block fits, block 0 is reserved


@pytest.mark.parametrize("utilization", [0.0, 1.01])
def test_utilization_is_a_share(utilization):
    with pytest.raises(AssertionError):
        plan_memory(GIB, utilization, 0, 0, 0, 0, GIB)


def test_the_ready_line_states_the_kv_cache_and_the_budget():
    assert device_note({"num_kv_blocks": 9}) == ""  # cpu, sim
    sized = device_note({"kv_cache_bytes": 48 * GIB, "memory_budget_bytes": 72 * GIB,
                         "memory_total_bytes": 80 * GIB})  # fmt: skip
    assert sized == (
        ", KV cache 48.00 GiB of a 72.00 GiB budget (0.90 of 80.00 GiB), kernels built and "
        "warmed up"
    )
    given = device_note({"kv_cache_bytes": GIB // 2})
    assert given == ", KV cache 0.50 GiB, kernels built and warmed up"
