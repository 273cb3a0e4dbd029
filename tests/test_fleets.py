"""What fleet gateways read from a running server (docs/fleets.md): each data-parallel replica's
KV event stream on its own port with its rank, the probes, and every metric name the page gives
the endpoint picker and Dynamo, parsed from /metrics as a Prometheus scraper parses it."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from tests.core.test_kv_events import decode_batch
from tests.server import Server, free_port

ROOT = Path(__file__).resolve().parents[1]
FLEETS = ROOT / "docs" / "fleets.md"


def replay(ctx: zmq.Context, port: int, start: int = 0) -> list[tuple[int, bytes]]:
    """Every batch a replica still keeps from `start` on, as (seq, payload)."""
    sock = ctx.socket(zmq.DEALER)
    sock.connect(f"tcp://127.0.0.1:{port}")
    sock.send_multipart([b"", start.to_bytes(8, "big")])
    out = []
    while True:
        assert sock.poll(5000), "the replay socket answers"
        _, _, seq, payload = sock.recv_multipart()
        if seq == (-1).to_bytes(8, "big", signed=True):
            break
        out.append((int.from_bytes(seq, "big"), payload))
    sock.close(0)
    return out


@pytest.mark.slow
def test_replicas_publish_on_their_own_ports_and_the_docs_metrics_exist(default_gguf):
    events, replays = free_port(), free_port()
    while replays in (events + 1, events - 1):
        replays = free_port()
    s = Server(
        "--model", str(default_gguf), "--device", "sim", "--served-model-name", "sim",
        "--dp", "2", "--kv-events-endpoint", str(events),
        "--kv-events-replay-endpoint", str(replays), "--kv-events-topic", "kv",
    )  # fmt: skip
    ctx = zmq.Context()
    try:
        prompt = " ".join(f"word{i}" for i in range(80))
        for tenant in ("acme", "globex", "acme", "globex"):
            body = {"model": "sim", "prompt": prompt, "max_tokens": 4}
            r = httpx.post(s.url + "/v1/completions", json=body, headers={"X-Tenant": tenant},
                           timeout=60)  # fmt: skip
            assert r.status_code == 200, r.text
        assert httpx.get(s.url + "/live", timeout=10).status_code == 200
        r = httpx.post(s.url + "/reset_prefix_cache", timeout=10)
        assert r.status_code == 200 and r.json() == {"reset": [True, True]}, r.text
        text = httpx.get(s.url + "/metrics", timeout=10).text
        stored = []
        for k in (0, 1):
            batches = replay(ctx, replays + k)
            assert [seq for seq, _ in batches] == list(range(len(batches)))
            for _, payload in batches:
                batch, decoded = decode_batch(payload)
                assert batch.data_parallel_rank == k
                stored += [e for e in decoded if type(e).__name__ == "BlockStored"]
            first, last = decode_batch(batches[0][1])[1][0], decode_batch(batches[-1][1])[1][-1]
            assert type(first).__name__ == "AllBlocksCleared", "each replica starts empty"
            assert type(last).__name__ == "AllBlocksCleared", "and the reset cleared it"
        scopes = {e.extra_keys[0] for e in stored if e.parent_block_hash is None}
        assert len(scopes) == 2, "the two tenants' blocks are told apart"
    finally:
        ctx.destroy(0)
        assert s.stop() == 0, s.read_log()
    exported: dict[str, list[dict[str, str]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            exported.setdefault(sample.name, []).append(sample.labels)
    named = set(re.findall(r"\b(gapless_[a-z_]+)\b", FLEETS.read_text()))
    # why: only with --enable-lora (tests/frontend/test_lora_serve.py reads it there)
    named.discard("gapless_lora_requests_info")
    assert len(named) >= 6
    assert not named - set(exported), "docs/fleets.md names series /metrics lacks"
    (info,) = exported["gapless_cache_config_info"]
    assert info["block_size"] == "16" and int(info["num_gpu_blocks"]) > 0
