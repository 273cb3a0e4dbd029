"""`gapless serve --data-parallel-size 2`: requests spread over the replicas, a repeated
prompt goes back to the replica holding it, each replica answers for itself, both replicas give
the same tokens, and one replica's death ends the engine."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator

import httpx
import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gapless.common.config import EngineConfig
from tests.server import Server
from tests.timing import late_limit_s

# how long the supervisor lets the frontends tell clients the engine is gone
GRACE_S = next(
    f.default for f in msgspec.structs.fields(EngineConfig) if f.name == "dead_engine_grace_s"
)

# in file order: the dp server is shared, and its last test kills it
pytestmark = [pytest.mark.slow, pytest.mark.randomly_dont_reorganize]


def _series(url: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """labels (model_name left out) -> value of every sample of one series on /metrics."""
    out = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for s in family.samples:
            if s.name == name:
                labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
                out[labels] = s.value
    return out


@pytest.fixture(scope="module")
def dp_server(default_gguf) -> Iterator[Server]:
    s = Server("--device", "sim", "--model", str(default_gguf), "--data-parallel-size", "2",
               "--served-model-name", "m")  # fmt: skip
    yield s
    s.stop()


def test_each_replica_runs_its_own_processes(dp_server):
    names = dp_server.child_pids()
    for title in ("gapless-core", "gapless-core.1", "gapless-detok", "gapless-detok.1",
                  "gapless-runner", "gapless-run0.1", "gapless-front0"):  # fmt: skip
        assert title in names, names
    assert any("2 replicas" in line for line in dp_server.log)


def test_requests_spread_and_a_repeated_prompt_finds_its_replica(dp_server):
    import openai

    client = openai.OpenAI(base_url=dp_server.url + "/v1", api_key="x", max_retries=0,
                           timeout=60)  # fmt: skip
    for i in range(6):  # short prompts, one at a time: no prefix, equal loads, in turn
        r = client.completions.create(model="m", prompt=f"hi {i}", max_tokens=3)
        assert r.usage.completion_tokens == 3
    routed = _series(dp_server.url, "gapless_routed_requests_total")
    by_load = {dict(k)["replica"]: v for k, v in routed.items() if dict(k)["reason"] == "load"}
    assert by_load.get("0", 0) >= 3 and by_load.get("1", 0) >= 3, routed
    busy = _series(dp_server.url, "gapless_replica_device_busy_seconds_total")
    assert busy[(("replica", "0"),)] > 0 and busy[(("replica", "1"),)] > 0, busy
    ranks = _series(dp_server.url, "gapless_rank_device_busy_seconds_total")
    assert set(ranks) == {(("rank", "0"), ("replica", "0")), (("rank", "0"), ("replica", "1"))}

    long = "The quick brown fox jumps over the lazy dog. " * 40  # ~400 tokens
    first = client.completions.create(model="m", prompt=long, max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    for _ in range(3):  # with both replicas idle, the one holding it wins each time
        again = client.completions.create(model="m", prompt=long, max_tokens=2)
        assert again.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 16
    routed = _series(dp_server.url, "gapless_routed_requests_total")
    assert sum(v for k, v in routed.items() if dict(k)["reason"] == "prefix") == 3, routed


def test_each_replica_answers_for_itself(dp_server):
    url = dp_server.url
    for k in (0, 1):
        stats = httpx.get(url + "/v1/engine/stats", params={"replica": k}, timeout=10).json()
        assert (stats["replica"], stats["num_replicas"]) == (k, 2)
        timeline = httpx.get(url + "/v1/engine/timeline", params={"replica": k, "last": 4},
                             timeout=10).json()  # fmt: skip
        assert timeline["replica"] == k and timeline["device"].startswith("sim")
    for bad in ("2", "-1", "x", "9" * 5000):
        r = httpx.get(url + "/v1/engine/stats", params={"replica": bad}, timeout=10)
        assert r.status_code == 400 and r.json()["error"]["param"] == "replica"
    r = httpx.get(url + "/v1/engine/timeline", params={"last": "9" * 5000}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "last"
    spec = httpx.get(url + "/openapi.json", timeout=10).json()
    (param,) = [p for p in spec["paths"]["/v1/engine/stats"]["get"]["parameters"]]
    assert param["name"] == "replica" and param["schema"]["maximum"] == 1


def test_both_replicas_of_two_ranks_give_the_same_tokens(tiny_model_dir):
    """cpu, float32, `--dp 2 --tp 2` (four gloo ranks, two groups): the same greedy text and
    logprobs from each replica (short prompts go to them in turn); a TP=2 runner is checked
    against one runner in tests/gpu_runner/test_tensor_parallel.py."""
    body = {"model": "tiny", "prompt": "one two three", "max_tokens": 12, "temperature": 0,
            "logprobs": 1}  # fmt: skip
    s = Server("--model", str(tiny_model_dir), "--dtype", "float32", "--served-model-name",
               "tiny", "--max-model-len", "256", "--dp", "2", "--tp", "2")  # fmt: skip
    try:
        answers = [
            httpx.post(s.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
            for _ in range(2)
        ]
        routed = _series(s.url, "gapless_routed_requests_total")
        ranks = _series(s.url, "gapless_rank_device_busy_seconds_total")
        names = s.child_pids()
    finally:
        s.stop()
    assert {dict(k)["replica"] for k in routed} == {"0", "1"}, routed
    assert sorted(dict(k)["replica"] + dict(k)["rank"] for k in ranks) == ["00", "01", "10", "11"]
    assert all(v > 0 for v in ranks.values()), ranks
    for title in ("gapless-runner", "gapless-runner1", "gapless-run0.1", "gapless-run1.1"):
        assert title in names, names
    assert answers[0]["text"] == answers[1]["text"], answers
    for x, y in zip(*(a["logprobs"]["token_logprobs"] for a in answers), strict=True):
        assert abs(x - y) <= 1e-4


def test_a_replica_that_dies_ends_the_engine(dp_server):
    """The last test of this file: it kills the module's server."""
    s = dp_server
    errors: list[str] = []

    def stream() -> None:
        body = {"model": "m", "prompt": "go", "max_tokens": 100_000, "ignore_eos": True,
                "stream": True}  # fmt: skip
        try:
            with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=30) as r:
                for line in r.iter_lines():
                    if '"error"' in line:
                        errors.append(line)
        except httpx.HTTPError as e:
            errors.append(repr(e))

    threads = [threading.Thread(target=stream) for _ in range(4)]
    for t in threads:
        t.start()
    time.sleep(1.0)  # both replicas have streams
    os.kill(s.child_pids()["gapless-core.1"], signal.SIGKILL)
    t0 = time.monotonic()
    code = s.proc.wait(30)
    took = time.monotonic() - t0
    for t in threads:
        t.join(10)
    # the supervisor polls every 0.1 s, then gives the frontends their grace to tell clients
    assert code == 1 and took < late_limit_s(GRACE_S), (code, took)
    assert len(errors) == 4, errors
    assert "process core.1" in s.read_log()
