"""`gapless serve` on the sim device given well-typed but impossible messages on every internal
socket that takes them: each process counts them in gapless_bad_messages_total{process,reason},
and the engine goes on serving."""

from __future__ import annotations

import time

import httpx
import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from gapless.common.channel import Sender
from gapless.common.messages import (
    AddRequest,
    DetokNew,
    GetStats,
    SamplingParams,
    StepPlan,
    StepResult,
    StepTiming,
    TokenBatch,
)
from tests.server import Server

pytestmark = pytest.mark.slow


def _bad_messages(server: Server) -> dict[tuple[str, str], float]:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return {
        (s.labels["process"], s.labels["reason"]): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "gapless_bad_messages_total"
    }


def test_impossible_messages_on_every_socket_leave_the_engine_serving(default_gguf) -> None:
    s = Server("--model", str(default_gguf), "--device", "sim", "--served-model-name", "sim")
    try:
        run_dir = s.run_dir()
        assert run_dir
        ctx = zmq.Context()
        params = SamplingParams(max_tokens=4)
        empty_plan = dict(new_slots=[], freed_slots=[], slots=[], num_tokens=[], start_pos=[])
        lists = dict(has_tokens=[], token_ids=[], sample=[], num_new_blocks=[], new_blocks=[])
        sent = {
            "core_in": [
                AddRequest("x-empty", 0, [], params, time.time()),
                AddRequest("x-far", 5, [1, 2, 3], params, time.time()),
                AddRequest("x-hashes", 0, [1] * 20, params, time.time(), block_hashes=[b"h"] * 4),
                GetStats(frontend_id=9, token=1),
            ],
            "runner_in": [StepPlan(seq=10**9, **empty_plan, **lists)],
            "runner_out": [StepResult(seq=10**9, token_ids=[], timing=StepTiming(0, 0, 0, 0, 0))],
            "detok_in": [
                DetokNew("x-detok", 7, params, [1]),
                TokenBatch(["x-detok"], [1, 1], [5], [""], [3]),
            ],
        }
        for socket, messages in sent.items():
            sender: Sender = Sender(ctx, f"ipc://{run_dir}/{socket}")
            for msg in messages:
                sender.send(msg)
            time.sleep(0.2)  # why: a PUSH socket closed at once may drop what it queued
            sender.close()
        ctx.term()
        body = {"model": "sim", "prompt": "still here", "max_tokens": 8, "ignore_eos": True}
        r = httpx.post(s.url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
        want = {
            ("core", "empty_prompt"): 1.0,
            ("core", "unknown_frontend"): 2.0,
            ("core", "block_hashes"): 1.0,
            ("core", "unplanned_result"): 1.0,
            ("gpu_runner", "plan_out_of_order"): 1.0,
            ("detokenizer", "detok_new"): 1.0,
            ("detokenizer", "token_batch"): 1.0,
        }
        deadline = time.monotonic() + 5
        while (got := _bad_messages(s)) != want and time.monotonic() < deadline:
            time.sleep(0.1)
        assert got == want
        assert httpx.get(s.url + "/health", timeout=2).status_code == 200
        r = httpx.post(s.url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 200, "and it still serves"
    finally:
        assert s.stop() == 0, s.read_log()
    log = s.read_log()
    assert "Traceback" not in log and "an impossible message (empty_prompt" in log, log
