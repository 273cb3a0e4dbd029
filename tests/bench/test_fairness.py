from __future__ import annotations

import json

import numpy as np
import pytest

from gapless.bench.client import RequestRecord
from gapless.bench.fairness import (
    Series,
    backlogged_window,
    jain_index,
    tenant_report,
    token_series,
)
from gapless.bench.figures import plot_runs, plot_saved
from gapless.bench.report import format_tenants, format_tenants_by_target
from gapless.bench.tenants import parse_tenants
from tests.bench.records import run_doc
from tests.bench.test_plots import assert_png

T0 = 100.0  # perf_counter at the run's start


def streamed(tenant, start, ttft, gap, num_chunks, output_tokens=None, ok=True):
    """A request of `tenant` sent `start` s into the run, chunks `gap` s apart after the first."""
    r = RequestRecord(8, num_chunks, ok=ok, tenant=tenant)
    r.start, r.ttft, r.itl = T0 + start, ttft, [gap] * (num_chunks - 1)
    r.e2e = ttft + gap * (num_chunks - 1)
    r.output_tokens = (num_chunks if output_tokens is None else output_tokens) if ok else 0
    return r


def series(t, tokens):
    return Series(np.asarray(t, dtype=float), np.asarray(tokens, dtype=float))


def test_jain_index():
    assert jain_index([5, 5, 5, 5]) == pytest.approx(1.0)
    assert jain_index([9, 0, 0]) == pytest.approx(1 / 3)
    assert jain_index([1, 3]) == pytest.approx(16 / 20)
    # weighted: tokens 20 and 10 with weights 2 and 1 are a fair split
    assert jain_index([20 / 2, 10 / 1]) == pytest.approx(1.0)
    assert jain_index([]) is None and jain_index([0, 0]) is None


def test_token_series_spreads_usage_over_chunks():
    done = streamed("A", 0.0, 0.5, 0.1, 4, output_tokens=8)  # chunks at 0.5..0.8, 2 tokens each
    broken = streamed("A", 0.2, 0.4, 0.2, 2, ok=False)  # chunks at 0.6, 0.8, 1 token each
    s = token_series([done, broken], T0)
    assert s.t == pytest.approx([0.5, 0.6, 0.6, 0.7, 0.8, 0.8])
    assert s.total == pytest.approx(10.0)
    assert s.at(0.0) == 0.0 and s.at(0.65) == pytest.approx(5.0) and s.at(9.0) == 10.0
    assert token_series([], T0).total == 0.0


def test_backlogged_window():
    first_send = {"A": 0.0, "B": 1.0}
    got = {"A": series([3.5], [1]), "B": series([5.5], [1])}
    w = backlogged_window(first_send, {"A": 3.0, "B": 5.0}, got)
    assert (w.start_s, w.end_s, w.duration_s, w.note) == (1.0, 3.0, 2.0, None)
    w = backlogged_window(first_send, {"A": 0.9, "B": 5.0}, got)
    assert w.start_s is None and w.duration_s is None
    assert w.note == (
        "no backlogged window: tenant A's last request started at 0.900 s, "
        "before tenant B sent its first at 1.000 s"
    )
    w = backlogged_window(first_send, {"A": 3.0, "B": None}, {**got, "B": series([], [])})
    assert w.note == "no backlogged window: tenant B received no tokens"


def noisy_records():
    """A hogs the server from 0 s; B sends at 1 s and gets its first token only at 3 s, after
    A's last: B is starved for the whole window [1, 2.9] s."""
    a = [streamed("A", 0.0, 0.1, 0.1, 29) for _ in range(3)]  # tokens 0.1 .. 2.9 s
    a.append(streamed("A", 0.0, 2.9, 0.1, 1))  # waits for a seat until 2.9 s
    b = [streamed("B", 1.0, 2.0, 0.1, 10)]  # tokens 3.0 .. 3.9 s
    return a + b


def test_tenant_report_of_a_starved_tenant():
    specs = parse_tenants("A:n=4,in=8,out=29;B:n=1,in=8,out=10,start=1,priority=interactive")
    doc = tenant_report(noisy_records(), T0, specs)
    f = doc["fairness"]
    assert f["window_start_s"] == pytest.approx(1.0) and f["window_end_s"] == pytest.approx(2.9)
    assert f["jain_index"] == pytest.approx(0.5) and f["note"] is None  # one of two gets all
    a, b = doc["tenants"]
    assert (a["name"], a["num_requests"], a["completed"], a["tokens_received"]) == ("A", 4, 4, 88)
    assert a["window_tokens"] == pytest.approx(3 * 19 + 1)  # tokens at 1.1 .. 2.9 s
    assert (a["window_share"], b["window_share"], b["window_tokens"]) == (1.0, 0.0, 0.0)
    assert a["weight_share"] == b["weight_share"] == 0.5
    assert b["priority"] == "interactive" and b["start_s"] == 1.0 and b["output_len"] == "10"
    assert b["ttft_ms"]["p50"] == pytest.approx(2000.0)
    assert b["first_send_s"] == pytest.approx(1.0) and b["last_token_s"] == pytest.approx(3.9)
    assert b["output_token_throughput"] == pytest.approx(10 / 2.9)
    assert b["series"]["t_s"][0] == pytest.approx(1.0) and b["series"]["tokens"][0] == 0.0
    assert b["series"]["tokens"][-1] == 10.0
    json.dumps(doc, allow_nan=False)


def test_weights_divide_the_tokens():
    # A and B stream side by side from 0 s, A twice as fast: fair for weights 2 and 1
    records = [streamed("A", 0.0, 0.05, 0.05, 40), streamed("B", 0.0, 0.1, 0.1, 20)]
    # each keeps one request waiting until 1.98 s: the window is [0, 1.98] s
    records += [streamed("A", 0.0, 1.98, 0.1, 1), streamed("B", 0.0, 1.98, 0.1, 1)]
    weighted = tenant_report(
        records, T0, parse_tenants("A:n=2,in=8,out=40,weight=2;B:n=2,in=8,out=20")
    )
    unweighted = tenant_report(records, T0, parse_tenants("A:n=2,in=8,out=40;B:n=2,in=8,out=20"))
    assert weighted["fairness"]["jain_index"] == pytest.approx(1.0)
    assert unweighted["fairness"]["jain_index"] == pytest.approx(0.9)  # 9 / (2 * 5)
    a, b = weighted["tenants"]
    assert a["weight_share"] == pytest.approx(2 / 3) and a["window_share"] == pytest.approx(2 / 3)


def test_no_window_gives_no_index():
    records = [streamed("A", 0.0, 0.1, 0.1, 5), streamed("B", 1.0, 0.1, 0.1, 5)]
    doc = tenant_report(records, T0, parse_tenants("A:n=1,in=8,out=5;B:n=1,in=8,out=5,start=1"))
    f = doc["fairness"]
    assert f["jain_index"] is None and f["window_s"] is None
    assert f["note"].startswith("no backlogged window: tenant A's last request started at")
    assert all(t["window_tokens"] is None and t["window_share"] is None for t in doc["tenants"])
    assert "Jain's fairness index: - (no backlogged window" in format_tenants({**doc})


def tenant_run(target):
    specs = parse_tenants("A:n=4,in=8,out=29;B:n=1,in=8,out=10,start=1")
    run = run_doc(target, 4.0, 0.2)
    run["workload"] = "tenants:A+B"
    run.update(tenant_report(noisy_records(), T0, specs))
    return run


def test_tenant_tables():
    run = tenant_run("fcfs")
    text = format_tenants(run)
    assert text.splitlines()[0].split()[:4] == ["tenant", "priority", "done/sent", "TTFT"]
    assert "4/4" in text and "100.0 %" in text
    assert "Jain's fairness index (tokens / weight, backlogged 1.000-2.900 s): 0.500" in text
    assert format_tenants_by_target([run]) == ""
    both = format_tenants_by_target([run, tenant_run("fair")])
    assert "fcfs" in both and "fair" in both and both.count("1.000-2.900 s): 0.500") == 2


def test_tenant_plot(tmp_path):
    runs = [tenant_run("fcfs"), run_doc("plain", 4.0, 0.2)]
    written = plot_runs(runs, [[], []], tmp_path)
    path = tmp_path / "tenants_fcfs_tenants_A_B.png"
    assert path in written and not (tmp_path / "tenants_plain_8_2.png").exists()
    assert_png(path, min_bytes=20000)
    (tmp_path / "saved.json").write_text(json.dumps({"runs": runs}))
    assert tmp_path / "again" / path.name in plot_saved(
        [tmp_path / "saved.json"], tmp_path / "again"
    )
