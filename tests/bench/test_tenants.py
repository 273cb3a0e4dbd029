from __future__ import annotations

import json
import math

import pytest

from gapless.bench.cli import main
from gapless.bench.tenants import (
    NOISY_NEIGHBOR,
    Lengths,
    TenantSpec,
    build_tenant_workload,
    parse_tenants,
    read_tenants_file,
    workload_name,
)
from tests.bench.fake_openai import FakeOpenAI, ThreadedServer
from tests.bench.test_plots import assert_png


def test_parse_spec():
    a, b = parse_tenants(
        "A:n=200,in=128,out=16-256,start=0; B: n=1, in=128, out=64, start=1.5, "
        "priority=interactive, weight=2, rate=4"
    )
    assert a == TenantSpec("A", 200, Lengths(128, 128), Lengths(16, 256))
    assert (b.name, b.num_requests, b.start_s, b.rate) == ("B", 1, 1.5, 4.0)
    assert (b.priority, b.weight, str(b.output_len)) == ("interactive", 2.0, "64")
    assert parse_tenants("c:n=2,in=8,out=4,priority=-1")[0].priority == -1
    assert parse_tenants("c:n=2,in=8,out=4,rate=inf")[0].rate == math.inf


def test_preset_alone_and_with_more_tenants():
    assert parse_tenants("noisy-neighbor") == NOISY_NEIGHBOR
    a, b = NOISY_NEIGHBOR
    assert (a.num_requests, str(a.output_len), a.start_s) == (200, "16-256", 0.0)
    assert (b.num_requests, str(b.output_len), b.start_s) == (1, "64", 1.0)
    assert workload_name(NOISY_NEIGHBOR) == "noisy-neighbor"
    specs = parse_tenants("noisy-neighbor;C:n=3,in=16,out=8,start=2")
    assert [s.name for s in specs] == ["A", "B", "C"]
    assert workload_name(specs) == "tenants:A+B+C"


@pytest.mark.parametrize(
    "spec,message",
    [
        ("", "no tenants"),
        ("noisy", "neither a preset"),
        ("A:n=2,in=8", "tenant 'A': missing out"),
        ("A:n=2,in=8,out=4,size=3", "tenant 'A': unknown key size"),
        ("A:n=0,in=8,out=4", "tenant 'A': n='0': want at least 1 request"),
        ("A:n=two,in=8,out=4", "tenant 'A': n='two': want an integer"),
        ("A:n=2,in=8,out=9-4", "tenant 'A': out='9-4': want N or LO-HI"),
        ("A:n=2,in=1,out=4", "tenant 'A': in='1'"),
        ("A:n=2,in=8,out=4,start=-1", "start='-1': want seconds >= 0"),
        ("A:n=2,in=8,out=4,rate=0", "rate='0': want requests/s > 0"),
        ("A:n=2,in=8,out=4,weight=0", "weight='0': want a weight > 0"),
        ("A:n=2,in=8,out=4,priority=urgent", "priority='urgent': want an integer or one of"),
        ("A:n=2,in=8,out=4,n=3", "tenant 'A': n given twice"),
        ("A:n=2,in=8,out=4,again=5+-1", "again='5+-1': want seconds >= 0"),
        ("A:n=2,in=8 out=4", "tenant 'A': 'in=8 out=4'"),
        ("A:n=2,in=8,out=4;A:n=1,in=8,out=4", "A given twice"),
        ("bad name:n=2,in=8,out=4", "tenant name 'bad name'"),
    ],
)
def test_bad_specs_name_the_bad_part(spec, message):
    with pytest.raises(ValueError) as exc:
        parse_tenants(spec)
    assert message in str(exc.value)


def test_tenants_file(tmp_path):
    path = tmp_path / "t.json"
    doc = {"tenants": [{"name": "A", "n": 4, "in": [8, 16], "out": "4-8", "weight": 3}]}
    path.write_text(json.dumps(doc))
    (a,) = read_tenants_file(path)
    assert a == TenantSpec("A", 4, Lengths(8, 16), Lengths(4, 8), weight=3.0)
    path.write_text(json.dumps([{"name": "A", "n": True, "in": 8, "out": 4}]))
    with pytest.raises(ValueError, match=r"t.json: tenant 'A': n=True: want an integer"):
        read_tenants_file(path)
    path.write_text(json.dumps([{"n": 1}]))
    with pytest.raises(ValueError, match="tenant #1 is not an object with a string name"):
        read_tenants_file(path)
    path.write_text("{")
    with pytest.raises(ValueError, match="t.json"):
        read_tenants_file(path)


def test_tenant_workload(maker):
    specs = parse_tenants("A:n=5,in=8-12,out=4-9;B:n=3,in=16,out=5,start=0.5,rate=10,priority=0")
    w = build_tenant_workload(specs, maker, seed=3)
    assert w == build_tenant_workload(specs, maker, seed=3)  # seeded
    assert w.tenants == specs and w.name == "tenants:A+B"
    a = [r for r in w.requests if r.tenant == "A"]
    b = [r for r in w.requests if r.tenant == "B"]
    assert len(a) == 5 and len(b) == 3
    assert all(8 <= r.prompt_len <= 12 and 4 <= r.output_len <= 9 for r in a)
    assert all(maker.count(r.prompt) == r.prompt_len for r in w.requests)
    assert all(r.arrival_s == 0.0 and r.priority is None for r in a)
    assert b[0].arrival_s == 0.5 and all(r.priority == 0 for r in b)
    assert sorted(r.arrival_s for r in b) == [r.arrival_s for r in b] and b[-1].arrival_s > 0.5
    with pytest.raises(ValueError, match="tenant 'A': in \\+ out can reach 21"):
        build_tenant_workload(specs, maker, seed=3, max_model_len=20)


def test_tenants_due_together_go_out_interleaved(maker):
    specs = parse_tenants("A:n=3,in=8,out=4;B:n=2,in=8,out=4;C:n=1,in=8,out=4,start=0.5")
    w = build_tenant_workload(specs, maker, seed=0)
    assert [r.tenant for r in w.requests] == ["A", "B", "A", "B", "A", "C"]


def test_a_tenant_that_comes_back(maker, tmp_path):
    (r,) = parse_tenants("R:n=3,in=8,out=4,start=1,again=20+10")
    assert r.starts == (1.0, 10.0, 20.0)
    w = build_tenant_workload((r,), maker, seed=0)
    assert [q.arrival_s for q in w.requests] == [1.0] * 3 + [10.0] * 3 + [20.0] * 3
    path = tmp_path / "t.json"
    path.write_text(json.dumps([{"name": "R", "n": 2, "in": 8, "out": 4, "again": [7, 3]}]))
    assert read_tenants_file(path)[0].again_s == (3.0, 7.0)


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--tenants", "A:n=1"], "--tenants: tenant 'A': missing in, out"),
        (["--tenants", "noisy-neighbor", "--workload", "8:4"], "--workload does not apply"),
        (["--tenants", "noisy-neighbor", "--num-requests", "3"], "--num-requests does not"),
        (["--tenants-file", "/nonexistent.json"], "--tenants-file /nonexistent.json"),
    ],
)
def test_cli_rejects_bad_tenants(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--base-url", "http://x", *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_tenant_run_against_two_fake_servers(default_gguf, tmp_path, capsys):
    apps = [FakeOpenAI(delay_s=0.003), FakeOpenAI(delay_s=0.003)]
    out_json, plot_dir = tmp_path / "r.json", tmp_path / "plots"
    spec = "A:n=6,in=8,out=40-60;B:n=2,in=8,out=20,start=0.02,priority=interactive,weight=2"
    with ThreadedServer(apps[0]) as fcfs, ThreadedServer(apps[1]) as fair:
        with pytest.raises(SystemExit) as exc:
            main(
                [
                    "--target", f"fcfs={fcfs.url}",
                    "--target", f"fair={fair.url}",
                    "--tenants", spec,
                    "--tokenizer", str(default_gguf),
                    "--no-progress",
                    "--output-json", str(out_json),
                    "--plot-dir", str(plot_dir),
                ]
            )  # fmt: skip
    printed = capsys.readouterr().out
    assert exc.value.code == 0, printed
    assert "Jain's fairness index" in printed and "tenants by target" in printed

    for app in apps:
        tenants = [h.get("x-tenant") for h in app.headers]
        assert sorted(tenants) == ["A"] * 6 + ["B"] * 2
        for header, body in zip(app.headers, app.bodies, strict=True):
            assert body["user"] == header["x-tenant"]
            assert body.get("priority") == ("interactive" if body["user"] == "B" else None)
            assert ("priority" in body) == (body["user"] == "B")

    doc = json.loads(out_json.read_text())
    assert [r["target"] for r in doc["runs"]] == ["fcfs", "fair"]
    for run in doc["runs"]:
        assert run["workload"] == "tenants:A+B" and run["completed"] == 8
        assert set(run["fairness"]) == {
            "window_start_s", "window_end_s", "window_s", "jain_index", "note"
        }  # fmt: skip
        fair = run["fairness"]
        if fair["jain_index"] is None:  # the fake server queues nothing: no backlog, no index
            assert fair["note"].startswith("no backlogged window")
        else:
            assert 0.5 <= fair["jain_index"] <= 1.0  # 1/n .. 1 for two tenants
        a, b = run["tenants"]
        assert set(a) == TENANT_KEYS
        assert (a["name"], a["num_requests"], a["completed"]) == ("A", 6, 6)
        assert (b["name"], b["num_requests"], b["weight"], b["weight_share"]) == (
            "B",
            2,
            2.0,
            2 / 3,
        )
        assert b["tokens_received"] == 40 and 6 * 40 <= a["tokens_received"] <= 6 * 60
        assert a["series"]["tokens"][-1] == a["tokens_received"]
        assert b["first_send_s"] >= 0.02 and b["ttft_ms"]["p99"] > 0
        assert_png(plot_dir / f"tenants_{run['target']}_tenants_A_B.png", min_bytes=20000)


TENANT_KEYS = {
    "name", "priority", "weight", "start_s", "again_s", "rate", "input_len", "output_len", "num_requests",
    "completed", "failed", "ttft_ms", "tokens_received", "output_token_throughput",
    "first_send_s", "last_token_s", "window_tokens", "window_share", "weight_share", "series",
}  # fmt: skip
