"""Fairness measured from the client side, over HTTP, against real `gapless serve` processes on
the sim device (h100-llama3-8b, 64 seats: sim figures), with bench's multi-tenant mode."""

from __future__ import annotations

import itertools
import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from gapless.bench.cli import main
from tests.server import Server

# why serial: the shares are read off client-side times, which other tests' load skews, so
# `make fairness-http` runs them alone on a quiet machine and `make test` does not;
# tests/core/test_fairness.py checks the same scenarios in process, a returning tenant and a
# tenant alone too (bench/RESULTS.md, "tenants: fcfs vs fair", has them over HTTP)
pytestmark = [pytest.mark.slow, pytest.mark.serial]


_seeds = itertools.count(1)


def bench(targets: dict[str, Server], spec: str, out_json) -> dict:
    """One bench run. Each run draws its own prompts (its own seed): the servers outlive a test,
    and a prompt another test sent would be found in the prefix cache, which charges its tenant
    nothing for the prompt and so gives that tenant more of the output."""
    args = [a for name, s in targets.items() for a in ("--target", f"{name}={s.url}")]
    args += ["--seed", str(next(_seeds))]
    with pytest.raises(SystemExit) as exc:
        main([*args, "--tenants", spec, "--no-progress", "--output-json", str(out_json)])
    assert exc.value.code == 0
    doc = json.loads(out_json.read_text())
    return {run["target"]: run for run in doc["runs"]} if "runs" in doc else {doc["target"]: doc}


def tenant(run: dict, name: str) -> dict:
    (row,) = [t for t in run["tenants"] if t["name"] == name]
    return row


@pytest.fixture(scope="module")
def servers(default_gguf):
    common = ("--model", str(default_gguf), "--device", "sim", "--sim-profile", "h100-llama3-8b")
    # tenant H weighs 2 (test_weights_over_http); the other tests' tenants weigh 1
    weights = {"fcfs": (), "fair": ("--tenant-weight", "H=2")}
    with ThreadPoolExecutor(len(weights)) as pool:  # why: the two start side by side
        futures = {
            p: pool.submit(Server, *common, "--scheduling-policy", p, *weights[p]) for p in weights
        }
    failed = [f.exception() for f in futures.values() if f.exception() is not None]
    started = {p: f.result() for p, f in futures.items() if f.exception() is None}
    if failed:  # the other one stops too
        for s in started.values():
            s.stop()
        raise failed[0]
    yield started
    for s in started.values():
        s.stop()


def test_noisy_neighbor_over_http(servers, tmp_path):
    runs = bench(servers, "noisy-neighbor", tmp_path / "nn.json")
    b = {p: tenant(runs[p], "B")["ttft_ms"]["p50"] for p in ("fcfs", "fair")}
    a = {p: tenant(runs[p], "A")["output_token_throughput"] for p in ("fcfs", "fair")}
    print(f"noisy neighbor over HTTP (sim): B's TTFT ms {b}, A's tok/s {a}")
    assert b["fair"] <= 0.2 * b["fcfs"], b
    assert a["fair"] >= 0.9 * a["fcfs"], "fairness costs the heavy tenant little throughput"


def test_equal_tenants_over_http(servers, tmp_path):
    # 300 requests each, not 50: with 64 seats a tenant's 50 all get one at once, and no tenant
    # would still be waiting when the fourth arrives; and not 200, whose ~3.6 s window with all
    # four backlogged read Jain 0.98 (shares 0.205-0.28) once on a busy two-core machine
    spec = ";".join(f"T{i + 1}:n=300,in=128,out=64-192,start={i}" for i in range(4))
    run = bench({"fair": servers["fair"]}, spec, tmp_path / "eq.json")["fair"]
    fairness = run["fairness"]
    shares = {t["name"]: round(t["window_share"], 3) for t in run["tenants"]}
    print(f"equal tenants over HTTP (sim): Jain {fairness['jain_index']:.4f} over "
          f"{fairness['window_s']:.1f} s all four backlogged, shares {shares}")  # fmt: skip
    assert fairness["window_s"] > 2.0, "a window long enough to mean something"
    assert fairness["jain_index"] >= 0.99, shares


def test_weights_over_http(servers, tmp_path):
    spec = "H:n=400,in=128,out=64-192,weight=2;L:n=400,in=128,out=64-192"
    run = bench({"fair": servers["fair"]}, spec, tmp_path / "w.json")["fair"]
    h, low = tenant(run, "H")["window_tokens"], tenant(run, "L")["window_tokens"]
    print(f"weights 2:1 over HTTP (sim): {h / low:.3f}:1 ({h:.0f} vs {low:.0f} tokens in "
          f"{run['fairness']['window_s']:.1f} s both backlogged)")  # fmt: skip
    assert run["fairness"]["window_s"] > 2.0
    assert 1.9 <= h / low <= 2.1, (h, low)


def test_interactive_over_a_batch_backlog_over_http(servers, tmp_path):
    fair = {"fair": servers["fair"]}
    # five interactive requests, 4/s, so the median is not one sample's luck
    v = "V:n=5,in=128,out=16,rate=4,priority=interactive"
    alone = bench(fair, v, tmp_path / "idle.json")
    busy = bench(
        servers, f"Bt:n=200,in=128,out=256,priority=batch;{v},start=1", tmp_path / "b.json"
    )
    idle = tenant(alone["fair"], "V")["ttft_ms"]["p50"]
    ttft = {p: tenant(busy[p], "V")["ttft_ms"]["p50"] for p in ("fcfs", "fair")}
    print(f"priority over HTTP (sim): interactive TTFT ms behind a batch backlog {ttft}, "
          f"idle {idle:.1f} ({ttft['fair'] / idle:.1f}x idle under fair)")  # fmt: skip
    # the batch backlog holds every seat: fcfs makes the interactive request wait for ~136 of
    # them; fair preempts one at once
    assert ttft["fair"] <= 0.1 * ttft["fcfs"], ttft
    # The figure is <= 3x idle (1.1-2.9x in bench runs, bench/RESULTS.md). Here the
    # TTFT is the host's too: the interactive request's first token waits behind the SSE
    # writes of 64 batch streams on the same two cores, and a quiet CI run read 3.3x once.
    # 5x keeps the check on the scheduler (fcfs reads ~300x) without timing the host.
    assert ttft["fair"] <= 5 * idle, (ttft, idle)
    for p in ("fcfs", "fair"):
        batch = tenant(busy[p], "Bt")
        assert batch["completed"] == 200, "none lost"
        assert batch["tokens_received"] == pytest.approx(200 * 256), "each in full"
