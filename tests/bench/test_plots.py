from __future__ import annotations

import json

import pytest

from gapless.bench.cli import main
from gapless.bench.figures import load_runs, plot_runs, plot_saved
from gapless.bench.timeline import timeline_summary
from tests.bench.records import run_doc, step

PNG = b"\x89PNG\r\n\x1a\n"


def assert_png(path, min_bytes=5000):
    data = path.read_bytes()
    assert data[:8] == PNG, path
    assert len(data) > min_bytes, (path, len(data))


def steps(n=60):
    out, t = [], 1.0
    for i in range(n):
        idle = 2.0 if i % 3 == 0 else 0.0
        t += idle / 1000
        out.append(step(i, t, 8.0, idle))
        t += 0.008
    return out


def gapless_run(target="gapless"):
    run = run_doc(target, 4.0, 0.2)
    run.update(
        timeline_summary({"steps": []}, {"device": "cpu", "overlap": True, "steps": steps()})
    )
    run["timeline"]["window_steps"] = steps()[10:50]
    run["samples"] = {"ttft_ms": [100.0, 200.0, 300.0], "itl_ms": [10.0, 11.0], "e2e_ms": [400.0]}
    return run


def foreign_run():
    run = run_doc("other", 3.0, 0.1)
    run["samples"] = {"ttft_ms": [50.0, 60.0], "itl_ms": [5.0, 9.0], "e2e_ms": [300.0, 350.0]}
    return run


def test_plots_are_pngs(tmp_path):
    runs = [gapless_run(), foreign_run()]
    written = plot_runs(runs, [steps(), []], tmp_path / "figs")
    names = sorted(p.name for p in written)
    assert names == ["breakdown.png", "latency_cdf.png", "timeline_gapless_8_2.png"]
    for path in written:
        assert_png(path)


def test_empty_runs_still_plot(tmp_path):
    run = foreign_run()
    run["samples"] = {}
    written = plot_runs([run], [[]], tmp_path)
    assert sorted(p.name for p in written) == ["breakdown.png", "latency_cdf.png"]
    for path in written:
        assert_png(path, min_bytes=2000)


def test_bench_plot_from_saved_json(tmp_path, capsys):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(gapless_run()))
    b.write_text(json.dumps({"runs": [gapless_run("gapless-no-overlap"), foreign_run()]}))
    assert [r["target"] for r in load_runs([a, b])] == ["gapless", "gapless-no-overlap", "other"]
    main(["plot", "--from", str(a), str(b), "--plot-dir", str(tmp_path / "out")])
    out = tmp_path / "out"
    for name in ("breakdown.png", "latency_cdf.png", "timeline_gapless_8_2.png"):
        assert_png(out / name)
    assert "breakdown.png" in capsys.readouterr().out


def test_plot_from_json_with_dropped_stages(tmp_path):
    # runs saved before the timeline lost its detokenize and stream fields hold those keys
    run = gapless_run()
    run["step_breakdown_ms"].update(detokenize=None, stream=None)
    (tmp_path / "old.json").write_text(json.dumps(run))
    written = plot_saved([tmp_path / "old.json"], tmp_path / "out")
    names = ["breakdown.png", "latency_cdf.png", "timeline_gapless_8_2.png"]
    assert sorted(p.name for p in written) == names
    for path in written:
        assert_png(path)


def test_cli_rejects_bad_arguments(capsys):
    for argv in (
        ["--workload", "32:8"],  # no target
        ["--base-url", "http://x", "--workload", "nope"],
        ["--base-url", "http://x", "--", "--model", "m"],  # serve args without --launch
        ["--base-url", "http://x", "--request-rate", "0"],
    ):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2
