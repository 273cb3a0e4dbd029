"""Tenants apart on a real server (sim, the default model's tokenizer): one tenant's prompt is
not in another's prefix cache, /metrics shows a tenant's key only its own series, and the
engine routes need the admin key."""

from __future__ import annotations

import json
import re
import time

import httpx
import numpy as np
import pytest

from tests.server import Server

pytestmark = pytest.mark.slow

KEYS = {
    "sk-a": "a",
    "sk-b": "b",
    "sk-c": {"tenant": "c", "share_prefix_cache": True},
    "sk-d": {"tenant": "d", "share_prefix_cache": True},
    "sk-ops": {"tenant": "ops", "admin": True},
}


@pytest.fixture(scope="module")
def server(default_gguf, tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys.json"
    keys.write_text(json.dumps(KEYS))
    s = Server(
        *("--model", str(default_gguf), "--device", "sim", "--sim-profile", "h100-llama3-8b"),
        *("--served-model-name", "smol", "--api-keys-file", str(keys), "--metrics-require-key"),
    )
    yield s
    assert s.stop() == 0, s.read_log()


def _auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def _send(server: Server, key: str, prompt: list[int], **extra) -> tuple[int, float]:
    """(cached_tokens, TTFT in ms) of one streamed completion."""
    body = {
        "model": "smol",
        "prompt": prompt,
        "max_tokens": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
        **extra,
    }
    t0 = time.perf_counter()
    ttft, usage = None, None
    url = server.url + "/v1/completions"
    with httpx.stream("POST", url, json=body, headers=_auth(key), timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[len("data: ") :])
            if event["choices"] and ttft is None:
                ttft = (time.perf_counter() - t0) * 1000
            usage = event.get("usage") or usage
    assert ttft is not None and usage is not None
    return usage["prompt_tokens_details"]["cached_tokens"], ttft


def test_another_tenants_prompt_is_not_in_your_cache(server) -> None:
    rng = np.random.default_rng(30)
    prompt, shared = (rng.integers(100, 40000, 4000).tolist() for _ in range(2))
    cached_a, ttft_a = _send(server, "sk-a", prompt)
    cached_b, ttft_b = _send(server, "sk-b", prompt)
    repeat_a, ttft_repeat = _send(server, "sk-a", prompt)
    print(
        f"sim: A first {cached_a} cached, {ttft_a:.0f} ms; B the same prompt {cached_b} cached, "
        f"{ttft_b:.0f} ms; A again {repeat_a} cached, {ttft_repeat:.0f} ms"
    )
    assert (cached_a, cached_b) == (0, 0)
    assert repeat_a >= 3984, "a tenant's own repeat hits"
    assert _send(server, "sk-a", prompt, cache_salt="s")[0] == 0, "a salt divides a pool"
    # c and d opted in: one pool between them, none with a or b
    assert _send(server, "sk-c", shared)[0] == 0
    assert _send(server, "sk-d", shared)[0] >= 3984
    assert _send(server, "sk-b", shared)[0] == 0
    assert _send(server, "sk-c", prompt)[0] == 0


def test_a_tenants_key_reads_its_own_metrics_and_no_engine_route(server) -> None:
    _send(server, "sk-a", [5] * 40)
    _send(server, "sk-b", [6] * 40)
    for path in ("/v1/engine/stats", "/v1/engine/timeline?last=4"):
        r = httpx.get(server.url + path, headers=_auth("sk-b"))
        assert r.status_code == 403 and r.json()["error"]["code"] == "admin_key_required"
        assert httpx.get(server.url + path, headers=_auth("sk-ops")).status_code == 200
    deadline = time.monotonic() + 10  # the core reports per-tenant service every few ms
    while True:
        everything = httpx.get(server.url + "/metrics", headers=_auth("sk-ops")).text
        if {"a", "b"} <= set(re.findall(r'tenant="([^"]*)"', everything)):
            break
        assert time.monotonic() < deadline, everything
        time.sleep(0.1)
    assert "gapless_requests_running{" in everything
    mine = httpx.get(server.url + "/metrics", headers=_auth("sk-b")).text
    assert set(re.findall(r'tenant="([^"]*)"', mine)) == {"b"}, mine
    assert "gapless_kv_blocks_total{" in mine
    assert "gapless_requests_running" not in mine and "gapless_time_to_first" not in mine
    assert httpx.get(server.url + "/metrics").status_code == 401
