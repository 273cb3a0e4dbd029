"""One bench invocation against a real `gapless serve` and a foreign OpenAI-compatible server."""

from __future__ import annotations

import json

import httpx
import pytest

from gapless.bench.cli import main
from tests.bench.fake_openai import FakeOpenAI, ThreadedServer
from tests.bench.test_plots import assert_png
from tests.server import Server

pytestmark = pytest.mark.slow

DISTRIBUTIONS = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")
STAGES = {"schedule", "prepare_inputs", "forward", "sample", "apply_result"}
REQUIRED = {
    "target", "workload", "num_requests", "completed", "failed", "duration_s",
    "request_throughput", "output_token_throughput", *DISTRIBUTIONS, "device",
    "device_idle_fraction", "step_breakdown_ms", "overlap",
}  # fmt: skip


@pytest.fixture(scope="module")
def gapless(tiny_model_dir):
    s = Server("--model", str(tiny_model_dir), "--dtype", "float32", "--served-model-name", "tiny")
    yield s
    assert s.stop() == 0, s.read_log()


def check_common(run, target, model, num_requests=8):
    assert REQUIRED <= set(run), REQUIRED - set(run)
    assert run["target"] == target and run["model"] == model
    assert run["workload"] == "32:8"
    assert (run["num_requests"], run["completed"], run["failed"]) == (num_requests, 8, 0)
    assert run["duration_s"] > 0
    assert run["request_throughput"] > 0 and run["output_token_throughput"] > 0
    assert run["output_token_throughput"] == pytest.approx(8 * 8 / run["duration_s"])
    for key in DISTRIBUTIONS:
        d = run[key]
        assert set(d) == {"mean", "p50", "p90", "p99"}
        assert all(isinstance(v, float) and v > 0 for v in d.values()), (key, d)
        assert d["p50"] <= d["p90"] <= d["p99"]
    assert set(run["step_breakdown_ms"]) == STAGES


def test_bench_two_targets_in_one_run(gapless, tmp_path, capsys):
    fake_app = FakeOpenAI()
    out_json, plot_dir = tmp_path / "result.json", tmp_path / "plots"
    with ThreadedServer(fake_app) as fake:
        with pytest.raises(SystemExit) as exc:
            main(
                [
                    "--target", f"gapless={gapless.url}",
                    "--target", f"fake={fake.url}/v1",
                    "--workload", "32:8",
                    "--num-requests", "8",
                    "--no-progress",
                    "--output-json", str(out_json),
                    "--plot-dir", str(plot_dir),
                ]
            )  # fmt: skip
    assert exc.value.code == 0, capsys.readouterr()
    printed = capsys.readouterr().out
    assert "gapless | 32:8" in printed and "fake | 32:8" in printed and "fake / gapless" in printed

    doc = json.loads(out_json.read_text())
    assert set(doc) == {"runs", "ratios"}
    g, f = doc["runs"]
    check_common(g, "gapless", "tiny")
    check_common(f, "fake", "fake-model")

    # the foreign server has no engine timeline: every engine key is null
    assert f["device"] is None and f["device_idle_fraction"] is None and f["overlap"] is None
    assert all(v is None for v in f["step_breakdown_ms"].values())
    assert all(b["ignore_eos"] and b["max_tokens"] == 8 for b in fake_app.bodies)

    # gapless serves /v1/engine/timeline, so its engine keys are filled
    timeline = httpx.get(gapless.url + "/v1/engine/timeline", params={"last": 1})
    assert timeline.status_code == 200, timeline.text
    assert g["device"] == "cpu" and isinstance(g["overlap"], bool)
    assert isinstance(g["device_idle_fraction"], float)
    assert 0.0 <= g["device_idle_fraction"] < 1.0
    assert g["step_breakdown_ms"]["forward"] > 0 and g["step_breakdown_ms"]["schedule"] > 0
    assert g["timeline"]["num_steps"] >= 8  # 8 output tokens need at least 8 steps

    (ratio,) = doc["ratios"]
    assert ratio["target"] == "fake" and ratio["baseline"] == "gapless"
    assert ratio["request throughput"] > 0

    assert_png(plot_dir / "breakdown.png")
    assert_png(plot_dir / "latency_cdf.png")
    assert_png(plot_dir / "timeline_gapless_32_8.png")


def test_bench_launches_and_stops_gapless(tiny_model_dir, tmp_path, capsys):
    out_json = tmp_path / "launch.json"
    with pytest.raises(SystemExit) as exc:
        main(
            [
                "--launch",
                "--workload", "16:4",
                "--num-requests", "3",
                "--request-rate", "50",
                "--no-progress",
                "--output-json", str(out_json),
                "--",
                "--model", str(tiny_model_dir),
                "--dtype", "float32",
                "--max-num-seqs", "2",
                "--no-compile",  # as tests/server.py serves: a compile would cost each run seconds
            ]
        )  # fmt: skip
    assert exc.value.code == 0, capsys.readouterr()
    run = json.loads(out_json.read_text())
    assert run["target"] == "gapless" and run["completed"] == 3 and run["failed"] == 0
    assert run["request_rate"] == 50.0
    port = int(run["base_url"].rsplit(":", 1)[1])
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)


def test_bench_tenants_against_launched_gapless(tiny_model_dir, tmp_path, capsys):
    out_json, plot_dir = tmp_path / "tenants.json", tmp_path / "plots"
    with pytest.raises(SystemExit) as exc:
        main(
            [
                "--launch",
                "--tenants", "A:n=4,in=16,out=8-16;B:n=2,in=16,out=8,start=0.2,priority=interactive",
                "--no-progress",
                "--output-json", str(out_json),
                "--plot-dir", str(plot_dir),
                "--",
                "--model", str(tiny_model_dir),
                "--dtype", "float32",
                "--max-num-seqs", "2",
                "--no-compile",  # as tests/server.py serves: a compile would cost each run seconds
            ]
        )  # fmt: skip
    assert exc.value.code == 0, capsys.readouterr()
    run = json.loads(out_json.read_text())
    assert run["target"] == "gapless" and run["device"] == "cpu"
    assert [(t["name"], t["completed"]) for t in run["tenants"]] == [("A", 4), ("B", 2)]
    assert run["tenants"][1]["priority"] == "interactive"
    assert set(run["fairness"]) >= {"window_start_s", "window_end_s", "jain_index", "note"}
    assert_png(plot_dir / "tenants_gapless_tenants_A_B.png")
