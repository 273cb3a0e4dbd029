"""The GPU check's report on made-up measurements: the issue's checks computed from them, the
markdown naming the card beside its figures, a partial run still written, the sim profile it
emits reproducing the measured step; and the run's parsers of pytest and server logs."""

from __future__ import annotations

import json

import pytest

from gapless.bench.gpu_check import floors
from gapless.bench.gpu_check.report import Report, checks, measure, render, sim_profiles
from gapless.bench.gpu_check.run import junit, startup_lines
from gapless.bench.gpu_check.shapes import SHAPES
from gapless.bench.gpu_check.steps import categories, category, step_record
from gapless.gpu_runner.sim.profiles import SimProfile, step_time

CARD = {
    "name": "NVIDIA H200", "memory_bytes": 143 * 2**30, "multiprocessors": 132,
    "capability": "9.0", "torch": "2.11.0+cu130", "cuda": "13.0", "flashinfer": "0.6.0",
    "bf16_peak_measured": 790e12, "read_bandwidth_measured": 4.3e12,
    "copy_bandwidth_measured": 4.2e12,
    "datasheet": {"hbm_bandwidth": 4.8e12, "bf16_peak": 989.4e12},
}  # fmt: skip
KERNELS = [
    ("sm90_xmma_gemm_bf16bf16_bf16f32", 600.0, 4),
    ("BatchDecodeWithPagedKVCacheKernel", 300.0, 32),
    ("void at::native::vectorized_elementwise_kernel<4, silu>", 50.0, 32),
    ("void at::native::reduce_kernel<MeanOps>", 30.0, 64),
    ("void at::native::index_copy_kernel", 20.0, 64),
]


def table(rows=KERNELS) -> list[dict]:
    total = sum(us for _, us, _ in rows)
    return [{"name": n, "category": category(n), "calls_per_step": c, "us_per_step": us,
             "share": us / total} for n, us, c in rows]  # fmt: skip


def profile(shape: str, batch: int, context: int, forward_ms: float, mixed_ms: float) -> dict:
    arch = SHAPES[shape].arch()
    decode = step_record(arch, floors.decode_entries(batch, context), [(forward_ms, forward_ms
                         + 0.5)] * 3, 4.8e12, 790e12, table())  # fmt: skip
    decode.update(batch=batch, context=context)
    entries = [floors.Entry(1024, 1024)] * 8 + floors.decode_entries(batch - 8, context)
    mixed = step_record(arch, entries, [(mixed_ms, mixed_ms + 1)] * 3, 4.8e12, 790e12, table())
    mixed.update(prompts=8, prompt_len=1024, decodes=batch - 8, tokens=8 * 1024 + batch - 8)
    return {"shape": shape, "decode": decode, "mixed": mixed}


def server(shape, overlap, tok_s, idle, **extra) -> dict:
    bench = {"output_token_throughput": tok_s, "device_idle_fraction": idle,
             "steady_decode_step_ms": 25.0, "ttft_ms": {"p50": 4600.0}, "completed": 256}  # fmt: skip
    return {"shape": shape, "overlap": overlap, "workload": "256 × 1024:256", "bench": bench,
            "issue_workload": "256 × 1024:512", **extra}  # fmt: skip


@pytest.fixture
def data() -> dict:
    return {
        "status": "complete", "budget_s": 450, "elapsed_s": 431.0, "card": CARD,
        "servers": [
            server("llama3-8b", True, 5870.0, 0.012, cold=True, first_ttft_ms=900.0,
                   warm_ttft_ms=[400.0], startup_s=95.0,
                   startup_lines=["kernels built in 80.1s (prompt and decode attention)"]),
            server("llama3-8b", False, 5556.0, 0.085),
            server("llama3.2-1b", True, 29571.0, 0.023),
            server("llama3.2-1b", False, 20298.0, 0.327),
        ],
        "profiles": [profile("llama3-8b", 256, 1250, 25.8, 150.0),
                     profile("llama3.2-1b", 128, 640, 1.5, 20.0)],
        "stages": [{"name": "card", "status": "ok", "seconds": 9.0}],
        "notes": [],
    }  # fmt: skip


def test_the_issues_checks_come_from_the_measurements(data):
    result = {c["check"]: c for c in checks(data)}
    eight = result["8B steady decode: step / HBM floor"]
    floor_ms = data["profiles"][0]["decode"]["hbm_floor_ms"]
    assert eight["value"] == pytest.approx(25.8 / floor_ms) and eight["pass"] is False  # 2.2x
    one = result["1B steady decode: step / HBM floor"]
    assert one["value"] == pytest.approx(1.5 / data["profiles"][1]["decode"]["hbm_floor_ms"])
    assert one["pass"] is True
    share = result["8B mixed step: share of the measured bf16 peak"]
    assert share["value"] == pytest.approx(data["profiles"][0]["mixed"]["flops"] / 0.150 / 790e12)
    assert result["8B overlap on: device idle"]["pass"] is True  # 1.2 %
    assert result["1B overlap on: device idle"]["pass"] is False  # 2.3 %
    assert result["8B output tok/s, overlap on / off"]["value"] == pytest.approx(5870 / 5556)
    assert result["cold kernel cache: first TTFT / warm median TTFT"]["value"] == 2.25
    assert result["cold kernel cache: first TTFT / warm median TTFT"]["pass"] is False


def test_what_a_run_did_not_reach_is_not_reached(data):
    data["profiles"] = [{"shape": "llama3-8b", "error": "RuntimeError: out of memory"}]
    data["servers"] = data["servers"][:1]
    result = {c["check"]: c for c in checks(data)}
    assert result["8B steady decode: step / HBM floor"]["pass"] is None
    assert result["8B output tok/s, overlap on / off"]["value"] is None
    assert measure(data, "llama3-8b", "idle_on") == 0.012
    text = render(data)
    assert "not reached" in text and "RuntimeError: out of memory" in text


def test_the_markdown_names_the_card_by_every_table(data, tmp_path):
    report = Report(tmp_path, data)
    report.save()
    text = (tmp_path / "report.md").read_text()
    assert text.startswith("# gapless GPU check on NVIDIA H200")
    assert "Served through `gapless bench` (NVIDIA H200)" in text
    assert "Steps against their floors (NVIDIA H200, in process)" in text
    assert "sm90_xmma_gemm_bf16bf16_bf16f32" in text and "matmul" in text
    assert "| llama3-8b | 256 × 1024:256 (256 × 1024:512) | on | 5,870 | 1.2 % | — |" in text
    assert "kernels built in 80.1s" in text
    assert "Kernels ran 1.00 ms of the 26.30 ms step (3.8 %)" in text  # 1,000 us of kernels
    saved = json.loads((tmp_path / "report.json").read_text())
    assert saved["checks"] == json.loads(json.dumps(checks(data)))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json", "report.md"]


def test_a_run_cut_short_still_writes_what_it_has(tmp_path):
    report = Report(tmp_path)
    report.save()
    assert "running" in (tmp_path / "report.md").read_text()
    report.data["card"] = CARD
    report.data["status"] = "cut short (SIGTERM)"
    report.save()
    saved = json.loads((tmp_path / "report.json").read_text())
    assert saved["status"] == "cut short (SIGTERM)" and saved["card"]["name"] == "NVIDIA H200"
    assert all(c["pass"] is None for c in saved["checks"])


def test_the_emitted_sim_profile_reproduces_the_measured_steps(data):
    emitted = {p["name"]: p for p in sim_profiles(data)}
    assert set(emitted) == {"h200-llama3-8b-gapless", "h200-llama3.2-1b-gapless"}
    p = SimProfile(**emitted["h200-llama3-8b-gapless"])
    assert (p.hbm_bandwidth, p.peak_flops) == (4.8e12, 989.4e12)  # the datasheet's
    d = data["profiles"][0]["decode"]
    modelled = step_time(p, d["batch"], d["batch"], d["batch"] * d["context"])
    assert modelled * 1e3 == pytest.approx(d["forward_ms"])
    m = data["profiles"][0]["mixed"]
    context = 8 * 1024 + m["decodes"] * d["context"]
    modelled = step_time(p, m["tokens"], 8 + m["decodes"], context, 8 * 1024)
    assert modelled * 1e3 == pytest.approx(m["forward_ms"])
    assert p.decode_scale > 1  # the runner is slower than the published-efficiency model here


def test_kernels_are_sorted_into_kinds():
    kinds = {n: category(n) for n, _, _ in KERNELS}
    assert list(kinds.values()) == ["matmul", "attention", "activation", "norm",
                                    "kv write / rope"]  # fmt: skip
    shares = categories(table())
    assert list(shares)[0] == "matmul" and sum(shares.values()) == pytest.approx(1.0)


def test_pytest_results_and_server_startup_lines(tmp_path):
    xml = tmp_path / "pytest.xml"
    xml.write_text(
        '<testsuites><testsuite tests="5" failures="1" errors="0" skipped="1">'
        '<testcase classname="tests.gpu_runner.test_cuda" name="test_a"/>'
        '<testcase classname="tests.gpu_runner.test_cuda" name="test_b">'
        '<failure message="assert 1 == 2">trace</failure></testcase>'
        "</testsuite></testsuites>"
    )
    result = junit(xml)
    assert (result["passed"], result["failed"], result["skipped"]) == (3, 1, 1)
    assert result["failures"] == [
        {"test": "tests.gpu_runner.test_cuda::test_b", "message": "assert 1 == 2"}
    ]
    assert junit(tmp_path / "none.xml") == {"error": "pytest wrote no results"}
    log = tmp_path / "serve.log"
    log.write_text(
        "gapless: loading /m on cuda ...\n"
        "12:00:01 INFO gapless.gpu_runner: cuda startup: weights loaded in 8.1s (15.1 GiB)\n"
        "12:01:30 INFO gapless.gpu_runner: cuda startup: kernels built in 81.0s (2 windows)\n"
        "gapless: engine ready in 95.2s: llama, 100 KV blocks of 16 tokens (1600 tokens)\n"
    )
    lines, ready = startup_lines(log)
    assert lines == ["weights loaded in 8.1s (15.1 GiB)", "kernels built in 81.0s (2 windows)"]
    assert ready.startswith("gapless: engine ready in 95.2s")
