"""A whole `gapless serve --device sim` under a burst far past --max-queued-requests: every
request gets 200 or 429 (none hangs, no 5xx), decisions stay fast, and the frontend's memory
comes back. `pytest -s` prints the figures."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server import Server

pytestmark = pytest.mark.slow

CAP, BURST, WARMUP = 50, 500, 100
BODY = {"prompt": "Tell me about queues and admission.", "max_tokens": 4, "ignore_eos": True}
DECISION = "gapless_admission_decision_seconds"


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def _scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    return {
        # every series carries model_name; these keys leave it out
        (s.name, tuple(sorted(kv for kv in s.labels.items() if kv[0] != "model_name"))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _buckets(m: dict) -> list[tuple[float, float]]:
    """(upper bound, cumulative count) of the decision histogram, in order."""
    found = [
        (float(dict(labels)["le"]), value)
        for (name, labels), value in m.items()
        if name == DECISION + "_bucket"
    ]
    return sorted(found)


def _quantile(q: float, buckets: list[tuple[float, float]]) -> float:
    """Prometheus' histogram_quantile: linear within the bucket that holds rank q * total."""
    total = buckets[-1][1]
    rank = q * total
    lower, below = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower
            return lower + (bound - lower) * (rank - below) / max(count - below, 1e-9)
        lower, below = bound, count
    return lower


async def _burst(url: str, num: int) -> list[httpx.Response]:
    limits = httpx.Limits(max_connections=num, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=120) as c:
        posts = [c.post("/v1/completions", json=BODY) for _ in range(num)]
        return await asyncio.wait_for(asyncio.gather(*posts), 240)


def test_a_burst_past_the_cap_is_answered_fast_and_leaves_no_memory(default_gguf) -> None:
    s = Server(
        "--device", "sim", "--sim-profile", "a100-llama-1.3b", "--max-num-seqs", "16",
        "--max-queued-requests", str(CAP),
    )  # fmt: skip
    try:
        pid = s.child_pids()["gapless-front0"]
        warm = asyncio.run(_burst(s.url, WARMUP))  # allocator growth settles
        assert {r.status_code for r in warm} <= {200, 429}
        before_m = _scrape(s.url)
        rss_before = _rss_bytes(pid)

        got = asyncio.run(_burst(s.url, BURST))

        statuses = [r.status_code for r in got]
        assert set(statuses) <= {200, 429}, sorted(set(statuses))
        refused = [r for r in got if r.status_code == 429]
        for r in refused:
            assert r.json()["error"]["code"] == "queue_full"
            assert 1 <= int(r.headers["retry-after"]) <= 60
        assert refused and statuses.count(200) >= CAP
        m = _scrape(s.url)
        grown = [
            (bound, count - dict(_buckets(before_m)).get(bound, 0.0))
            for bound, count in _buckets(m)
        ]
        assert grown[-1][1] == BURST  # one decision per request
        p99 = _quantile(0.99, grown)
        key = ("gapless_requests_rejected_total", (("reason", "queue_full"),))
        assert m[key] - before_m.get(key, 0.0) == len(refused)
        rss_after = _rss_bytes(pid)
        retry = sorted(int(r.headers["retry-after"]) for r in refused)
        print(
            f"\nadmission burst of {BURST} (cap {CAP}, 16 seats, sim a100-llama-1.3b): "
            f"{statuses.count(200)} x 200, {len(refused)} x 429 "
            f"(Retry-After {retry[0]}-{retry[-1]} s); decision p99 {p99 * 1e3:.2f} ms; "
            f"frontend RSS {rss_before / 2**20:.1f} -> {rss_after / 2**20:.1f} MiB "
            f"({(rss_after - rss_before) / rss_before:+.1%})"
        )
        assert p99 < 0.05
        assert abs(rss_after - rss_before) <= 0.10 * rss_before
    finally:
        assert s.stop() == 0, s.read_log()
