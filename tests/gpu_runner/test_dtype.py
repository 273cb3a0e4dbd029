"""--dtype auto: bfloat16 only where the CPU computes it natively; --quantization auto: w8a8
(or int8, without fbgemm) where --dtype auto would serve float32 weights, int4-dual where it
serves bfloat16 from a Q4_1 GGUF."""

from __future__ import annotations

import os

import pytest

from gapless.gpu_runner.cpu import formats


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
    monkeypatch.setattr(formats, "cpu_flags", lambda: flags)
    assert formats.resolve_dtype("auto", device) == want
    assert formats.resolve_dtype("float16", device) == "float16", "a dtype asked for is kept"


@pytest.mark.parametrize(
    "flags, dtype, device, want",
    [
        ({"avx2", "fma"}, "auto", "cpu", "w8a8"),  # float32 weights otherwise
        ({"avx512f", "avx512_bf16"}, "auto", "cpu", "none"),  # bfloat16 weights
        ({"avx2", "fma"}, "float32", "cpu", "none"),  # float32 asked for: the exact path
        ({"avx2", "fma"}, "bfloat16", "cpu", "none"),
        ({"avx2"}, "auto", "cuda", "none"),
    ],
)
def test_auto_quantization_is_w8a8_only_where_auto_dtype_is_float32_on_cpu(
    monkeypatch, flags, dtype, device, want
):
    monkeypatch.setattr(formats, "cpu_flags", lambda: flags)
    monkeypatch.setattr(formats, "has_fbgemm", lambda: True)
    assert formats.resolve_quantization("auto", dtype, device) == want
    assert formats.resolve_quantization("int4", "auto", "cpu") == "int4", "a format asked for"
    assert formats.resolve_quantization("none", "auto", "cpu") == "none"


@pytest.mark.slow
def test_auto_quantization_is_int4_dual_for_a_q4_1_gguf_where_bfloat16_is_native(
    monkeypatch, default_gguf, tiny_model_dir
) -> None:
    monkeypatch.setattr(formats, "cpu_flags", lambda: {"avx512f", "avx512_bf16"})
    assert formats.resolve_quantization("auto", "auto", "cpu", str(default_gguf)) == "int4-dual"
    # safetensors: int4 would round float weights, so the --dtype weights stay
    assert formats.resolve_quantization("auto", "auto", "cpu", str(tiny_model_dir)) == "none"
    assert formats.resolve_quantization("auto", "bfloat16", "cpu", str(default_gguf)) == "none"
    monkeypatch.setattr(formats, "cpu_flags", lambda: {"avx2", "fma"})
    assert formats.resolve_quantization("auto", "auto", "cpu", str(default_gguf)) == "w8a8"


def test_auto_quantization_is_int8_where_torch_has_no_fbgemm(monkeypatch) -> None:
    monkeypatch.setattr(formats, "cpu_flags", lambda: {"asimd"})  # an Arm CPU without BF16
    monkeypatch.setattr(formats, "has_fbgemm", lambda: False)
    assert formats.resolve_quantization("auto", "auto", "cpu") == "int8"


def test_fbgemm_is_found_in_an_x86_torch() -> None:
    import platform

    if platform.machine() in ("x86_64", "AMD64"):
        assert formats.has_fbgemm()


def test_cpu_flags_reads_this_machine():
    flags = formats.cpu_flags()
    if os.path.exists("/proc/cpuinfo"):
        assert flags and all(f == f.strip() and f for f in flags)
    assert formats.resolve_dtype("auto", "cpu") in ("bfloat16", "float32")
