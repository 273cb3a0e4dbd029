"""--dtype auto: bfloat16 only where the CPU computes it natively."""

from __future__ import annotations

import os

import pytest

from gapless.gpu_runner import runner


@pytest.mark.parametrize(
    "flags, device, want",
    [
        ({"avx2", "fma"}, "cpu", "float32"),  # AVX2 only: bfloat16 goes through float32
        ({"avx512f", "avx512_bf16"}, "cpu", "bfloat16"),
        ({"amx_tile", "amx_bf16"}, "cpu", "bfloat16"),
        ({"asimd", "bf16"}, "cpu", "bfloat16"),  # Arm
        (set(), "cpu", "float32"),  # no /proc/cpuinfo
        ({"avx2"}, "cuda", "bfloat16"),
    ],
)
def test_auto_dtype_is_bfloat16_only_where_it_is_computed_natively(
    monkeypatch, flags, device, want
):
    monkeypatch.setattr(runner, "cpu_flags", lambda: flags)
    assert runner.resolve_dtype("auto", device) == want
    assert runner.resolve_dtype("float16", device) == "float16", "a dtype asked for is kept"


def test_cpu_flags_reads_this_machine():
    flags = runner.cpu_flags()
    if os.path.exists("/proc/cpuinfo"):
        assert flags and all(f == f.strip() and f for f in flags)
    assert runner.resolve_dtype("auto", "cpu") in ("bfloat16", "float32")
