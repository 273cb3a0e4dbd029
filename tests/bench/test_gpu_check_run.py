"""The GPU check's plans and plumbing, without a GPU: the in-process profile's hand-made plans
on the cpu runner, and the whole check rehearsed on this machine's cpu (run.py --rehearse)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from gapless.bench.gpu_check import run
from gapless.bench.gpu_check.steps import Driver, decode_plan, mixed_plans, start_decoding
from gapless.gpu_runner.cpu.backend import CpuBackend
from tests.engine_harness import make_config

BS = 16


def test_the_profile_plans_run_on_the_runner(tiny_model_dir):
    runner = CpuBackend(make_config(tiny_model_dir, block_size=BS, max_num_seqs=4,
                                     max_num_batched_tokens=2 * 40 + 4))  # fmt: skip
    driver = Driver(runner, BS)
    start_decoding(driver, batch=4, context=50, room=20, vocab=1000)
    assert driver.context == dict.fromkeys(range(4), 50)
    assert driver.next_block == 1 + 4 * -(-70 // BS)
    for _ in range(3):
        forward_ms, step_ms = driver.step(decode_plan(driver, 4))
        assert 0 < forward_ms <= step_ms
    assert driver.context == dict.fromkeys(range(4), 53)
    plans = list(mixed_plans(driver, batch=4, prompts=2, prompt_len=40, reps=3, vocab=1000))
    assert len(plans) == 3 and [p.seq for p in plans] == [5, 6, 7]
    for plan in plans:
        driver.step(plan)
        assert plan.freed_slots == [0, 1] and [n.slot for n in plan.new_slots] == [0, 1]
        assert plan.num_tokens == [40, 40, 1, 1] and plan.start_pos[:2] == [0, 0]
        assert plan.new_blocks == plans[0].new_blocks  # the prompts reuse their blocks
    assert driver.context == {0: 40, 1: 40, 2: 56, 3: 56}


def test_server_and_profile_names():
    serve = run.PLAN.main[0]
    assert serve.cold and serve.shape == "llama3-8b" and serve.num_requests == 256
    assert run.serve_name(serve) == "serve llama3-8b, overlap on, cold"
    assert [p.shape for p in run.PLAN.profiles] == ["llama3-8b", "llama3.2-1b"]
    assert run.PLAN.profiles[0].spec()["decode_context"] == 1250
    assert run._user_args(["--out", "x", "--installed", "--t0", "1"]) == ["--out", "x"]


@pytest.mark.slow
def test_the_rehearsal_writes_the_whole_report(tmp_path, default_gguf):
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, str(run.ROOT / "bench/gpu_check/run.py"), "--rehearse", "--out",
         str(out), "--work", str(tmp_path / "work"), "--budget", "280"],
        capture_output=True, text=True, timeout=400, cwd=tmp_path,
        env=dict(os.environ, GAPLESS_CACHE_DIR=str(default_gguf.parent)),
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["report.json", "report.md"]
    report = json.loads((out / "report.json").read_text())
    assert report["status"] == "complete", report["stages"]
    assert [s["status"] for s in report["stages"]] == ["ok"] * 4
    on, off = report["servers"]
    assert (on["overlap"], off["overlap"]) == (True, False)
    assert on["bench"]["completed"] == off["bench"]["completed"] == 8
    assert on["first_ttft_ms"] > 0 and len(on["warm_ttft_ms"]) == 1
    assert "engine ready in" in on["ready_line"] and on["floor"]["hbm_floor_ms"] > 0
    (profile,) = report["profiles"]
    assert profile["decode"]["batch"] == 4 and profile["mixed"]["prompts"] == 2
    assert profile["decode"]["kernels"][0]["category"] == "matmul"  # aten::mm, on a cpu
    assert report["sim_profiles"][0]["name"].endswith("smollm2-135m-gapless")
    text = (out / "report.md").read_text()
    assert text.startswith("# gapless GPU check on cpu") and "not reached" in text


def test_background_work_pauses_while_a_run_is_measured(tmp_path):
    import argparse
    import time

    work = tmp_path / "work"
    work.mkdir()
    (work / "install.json").write_text(json.dumps({"bundle": None}))
    args = argparse.Namespace(work=str(work), t0=time.time(), budget=60.0, rehearse=True,
                              out=str(tmp_path / "out"), argv=[], warm_jit=False)  # fmt: skip
    check = run.Check(args)
    ticks = tmp_path / "ticks"
    counter = "import time\nwhile True:\n    open(%r, 'a').write('.')\n    time.sleep(0.01)\n"
    proc = check.spawn("ticker", [sys.executable, "-c", counter % str(ticks)])
    check.background_procs.append(proc)
    try:
        time.sleep(0.5)
        assert ticks.stat().st_size > 5  # it runs
        with check.quiet("measured run"):
            time.sleep(0.2)  # the watcher stops it within its 50 ms poll
            before = ticks.stat().st_size
            time.sleep(0.5)
            assert ticks.stat().st_size == before  # nothing ran while measured
        time.sleep(0.3)
        assert ticks.stat().st_size > before  # and it goes on after
        assert check.paused_s > 0.5
    finally:
        check.stop_all()
    assert proc.poll() is not None
