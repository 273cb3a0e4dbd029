"""A malformed frame on an internal socket is dropped, logged and counted; the receiver goes on.
A ring name from a frame never leaves /dev/shm nor our run's prefix. A well-typed message that
cannot be (an impossible request, a result of no planned step) is counted and dropped, or ends
its one request, and the engine goes on serving."""

from __future__ import annotations

import os
import struct
import time
from collections import deque
from pathlib import Path

import msgspec
import pytest
import zmq
from prometheus_client import REGISTRY

from gapless.common.channel import Receiver, Sender
from gapless.common.messages import (
    Abort,
    AddRequest,
    CoreInput,
    GetStats,
    GetTimeline,
    SamplingParams,
    StepRefused,
    StepResult,
    StepTiming,
)
from gapless.gpu_runner.sim.backend import SimBackend
from gapless.shm.frames import ANNOUNCE, MARK, RECORD
from gapless.shm.names import SHM_DIR, check_ring_name
from gapless.shm.ring import HEADER_BYTES, MAGIC
from tests.conftest import sim_config
from tests.engine_harness import Harness

_REF = struct.Struct("<BBQI")


def _ref(kind: int, name: bytes, pos: int = 0, length: int = 0) -> bytes:
    return _REF.pack(MARK, kind, pos, length) + name


def _fake_ring(path: Path, capacity: int = 4096) -> bytes:
    """A file laid out like a ring's header, as a frame's target elsewhere on disk."""
    words = [0] * (HEADER_BYTES // 8)
    words[0], words[1] = MAGIC, capacity
    data = struct.pack(f"{len(words)}Q", *words) + bytes(capacity)
    path.write_bytes(data)
    return data


def _bad(socket: str) -> float:
    return REGISTRY.get_sample_value("gapless_bad_frames_total", {"socket": socket}) or 0.0


def test_malformed_frames_are_dropped_and_counted(tmp_path: Path, caplog) -> None:
    run = tmp_path / "gapless-1-test"
    run.mkdir()
    address = f"ipc://{run}/core_in"
    outside = tmp_path / "outside"
    original = _fake_ring(outside)
    escape = os.path.relpath(outside, SHM_DIR).encode()  # ../../tmp/.../outside
    ctx = zmq.Context()
    inbox: Receiver[CoreInput] = Receiver(ctx, address, CoreInput)
    raw = ctx.socket(zmq.PUSH)
    raw.connect(address)
    sender: Sender[CoreInput] = Sender(ctx, address)
    before = _bad("core_in")
    try:
        frames = [
            b"\xff\x00garbage",  # not msgpack
            msgspec.msgpack.encode({"not": "a message"}),  # msgpack, not of the union
            msgspec.msgpack.encode(["Abort", [1, 2]]),  # the tag, wrong field types
            b"\xc1",  # a reference frame cut short
            _ref(ANNOUNCE, escape),  # a path out of /dev/shm
            _ref(ANNOUNCE, b"gapless-other-run-x-1-0"),  # another run's ring
            _ref(ANNOUNCE, b"\xff\xfe"),  # not a name
            _ref(RECORD, b"gapless-1-test-core_in-1-0", 0, 8),  # a ring never announced
            _ref(7, b"gapless-1-test-core_in-1-0"),  # no such kind
        ]
        for frame in frames:
            raw.send(frame)
        sender.send(Abort(["still-here"]))
        got = inbox.recv(timeout_ms=5000)
        assert got == Abort(["still-here"])
        assert inbox.drain() == []
    finally:
        for s in (raw, sender.socket):
            s.close(linger=0)
        inbox.close()
        ctx.term()
    assert _bad("core_in") - before == len(frames)
    assert outside.read_bytes() == original, "a frame's ring name wrote a file outside /dev/shm"
    assert "dropped a malformed frame" in caplog.text


@pytest.mark.parametrize(
    "name",
    ["../x", "gapless-../../etc/passwd", "gapless-a/b", "other-1-x", "gapless-", "", ".."],
)
def test_ring_names_are_checked(name: str) -> None:
    with pytest.raises(ValueError):
        check_ring_name(name)


def test_ring_names_of_another_run_are_refused() -> None:
    assert check_ring_name("gapless-12-ab-core_in-3-0", "12-ab") == "gapless-12-ab-core_in-3-0"
    with pytest.raises(ValueError):
        check_ring_name("gapless-13-ab-core_in-3-0", "12-ab")


# ------------------------------------------------------------------ well-typed, impossible
# Each message below decodes; what it says cannot be. The process that receives it counts it in
# gapless_bad_messages_total{process,reason} and drops it, or ends that one request with an
# error, and goes on serving the others.

PROMPT = list(range(1000, 1040))  # 40 tokens: 2 full blocks of 16


def _bad_messages(process: str, reason: str) -> float:
    labels = {"process": process, "reason": reason}
    return REGISTRY.get_sample_value("gapless_bad_messages_total", labels) or 0.0


@pytest.fixture(scope="module")
def sim(default_gguf):
    return sim_config(default_gguf, max_num_seqs=4, max_num_batched_tokens=64, seed=5)


def _harness(config) -> Harness:
    return Harness(config, backend=SimBackend(config))


def _add(rid: str, prompt=PROMPT, params=None, **fields) -> AddRequest:
    return AddRequest(
        request_id=rid,
        frontend_id=fields.pop("frontend_id", 0),
        prompt_token_ids=prompt,
        params=params or SamplingParams(max_tokens=4),
        arrival_time=time.time(),
        **fields,
    )


def _params(**fields) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 4, **fields})


# (case, message, reason counted, ended with an error: else dropped)
IMPOSSIBLE_REQUESTS = [
    ("more-hashes-than-blocks", _add("x", block_hashes=[b"h" * 32] * 3), "block_hashes", True),
    ("empty-prompt", _add("x", prompt=[]), "empty_prompt", True),
    ("token-past-vocab", _add("x", prompt=[49152] * 20), "token_out_of_vocab", True),
    ("negative-token", _add("x", prompt=[-1] * 20), "token_out_of_vocab", True),
    ("huge-token", _add("x", prompt=[2**64 - 1]), "token_out_of_vocab", True),
    ("priority", _add("x", priority=10**6), "priority_out_of_range", True),
    ("no-max-tokens", _add("x", params=_params(max_tokens=0)), "params_out_of_range", True),
    (
        "nan-temperature",
        _add("x", params=_params(temperature=float("nan"))),
        "params_out_of_range",
        True,
    ),  # noqa: E501
    ("top-p-zero", _add("x", params=_params(top_p=0.0)), "params_out_of_range", True),
    ("top-k-past-vocab", _add("x", params=_params(top_k=10**6)), "params_out_of_range", True),
    ("logprobs", _add("x", params=_params(logprobs=10**6)), "params_out_of_range", True),
    ("stop-id", _add("x", params=_params(stop_token_ids=(-3,))), "params_out_of_range", True),
    ("bias-id", _add("x", params=_params(logit_bias=((10**9, 1.0),))), "params_out_of_range", True),
    (
        "no-allowed-ids",
        _add("x", params=_params(allowed_token_ids=())),
        "params_out_of_range",
        True,
    ),  # noqa: E501
    (
        "bad-word-id",
        _add("x", params=_params(bad_words_ids=((5, 10**8),))),
        "params_out_of_range",
        True,
    ),  # noqa: E501
    ("unknown-frontend", _add("x", frontend_id=3), "unknown_frontend", False),
    ("negative-frontend", _add("x", frontend_id=-1), "unknown_frontend", False),
]


@pytest.mark.parametrize(
    "msg, reason, ended",
    [c[1:] for c in IMPOSSIBLE_REQUESTS],
    ids=[c[0] for c in IMPOSSIBLE_REQUESTS],
)
def test_an_impossible_add_request_ends_alone(sim, msg, reason, ended) -> None:
    h = _harness(sim)
    before = _bad_messages("core", reason)
    h.deltas["x"], h.outputs["x"], h.token_steps["x"] = [], [], []
    h.core.handle(msg)
    h.run({0: [("ok", PROMPT, _params())], 1: [("after", PROMPT, _params())]})
    assert h.finish["ok"] == h.finish["after"] == "length", "the engine goes on serving"
    assert len(h.outputs["ok"]) == len(h.outputs["after"]) == 4
    assert _bad_messages("core", reason) - before == 1
    if ended:  # its frontend hears one error, and nothing of it is left
        (delta,) = h.deltas["x"]
        assert delta.finish_reason == "error" and "impossible request" in delta.error
        assert h.finish["x"] == "error" and h.outputs["x"] == []
    else:  # nobody to tell: nothing reaches the detokenizer
        assert "x" not in h.finish and h.deltas["x"] == []
    s = h.scheduler
    assert s.requests == {} and s.blocks.num_free == s.blocks.num_usable
    assert h.detok.num_requests == 0


def test_a_live_request_id_sent_again_is_dropped(sim) -> None:
    h = _harness(sim)
    before = _bad_messages("core", "duplicate_request_id")
    h.add("ok", PROMPT, _params(max_tokens=8))
    h.core.handle(_add("ok", prompt=[5] * 20, params=_params(max_tokens=2)))
    h.run()
    assert h.finish == {"ok": "length"} and len(h.outputs["ok"]) == 8, "the first one is untouched"
    assert _bad_messages("core", "duplicate_request_id") - before == 1


def test_replies_to_a_frontend_that_does_not_exist_are_dropped(sim) -> None:
    h = _harness(sim)
    before = _bad_messages("core", "unknown_frontend")
    h.core.handle(GetStats(frontend_id=5, token=1))
    h.core.handle(GetTimeline(frontend_id=-2, token=2, last=10))
    h.core.handle(GetStats(frontend_id=0, token=3))
    out = h.core.step()
    assert [(fid, type(m).__name__) for fid, m in out.frontend][:1] == [(0, "EngineStats")]
    assert all(fid == 0 for fid, _ in out.frontend)
    assert _bad_messages("core", "unknown_frontend") - before == 2


def _drive(h, results):
    """Steps the harness's engine by hand; results(step, result) may replace a step's result.
    Returns when every request ended."""
    inflight: deque = deque()
    result, k = None, 0
    while inflight or h.core.has_work or result is not None:
        out = h.core.step(result)
        for plan in out.plans:
            inflight.append(h.backend.launch(plan))
        for msg in out.detok:
            h._detokenize(msg)
        result = h.backend.collect(inflight.popleft()) if inflight else None
        if result is not None:
            result = results(k, result)
        k += 1
        assert k < 1000, "no progress"


def test_a_result_of_a_step_never_planned_is_dropped(sim) -> None:
    h = _harness(sim)
    before = _bad_messages("core", "unplanned_result")
    timing = StepTiming(0.0, 0.0, 0.0, 0.0, 0.0)
    # nothing in flight yet: before, an IndexError (pop from an empty deque) ended the core
    h.core.step(StepResult(seq=7, token_ids=[1, 2], timing=timing))
    for rid in ("a", "b"):
        h.add(rid, PROMPT, _params(max_tokens=6))

    def stray(k, result):
        if k == 3:  # a stale result, then one far ahead, before the real one
            h.core.step(StepResult(seq=result.seq - 1, token_ids=[9], timing=timing))
            h.core.step(StepResult(seq=result.seq + 50, token_ids=[], timing=timing))
        return result

    _drive(h, stray)
    assert h.finish == {"a": "length", "b": "length"}
    assert len(h.outputs["a"]) == len(h.outputs["b"]) == 6
    assert 9 not in h.outputs["a"] + h.outputs["b"]
    assert _bad_messages("core", "unplanned_result") - before == 3


def test_a_refused_plan_ends_that_steps_requests_and_the_engine_goes_on(sim) -> None:
    """The runner refuses a plan it cannot run (gpu_runner/plan_check.py) in its result's
    place: that step's requests end with an error, nothing waits for a result that will not
    come, and the next request is served."""
    h = _harness(sim)
    h.add("a", PROMPT, _params(max_tokens=8))
    h.add("b", PROMPT, _params(max_tokens=8))
    refused = {}

    def refuse(k, result):
        if k == 4 and len(result.token_ids) == 2:
            refused["seq"] = result.seq
            return StepRefused(result.seq, "plan_slots: a slot not in use")
        return result

    _drive(h, refuse)
    assert refused, "the step was found"
    assert h.finish == {"a": "error", "b": "error"}
    assert all("the runner refused step" in h.deltas[r][-1].error for r in ("a", "b"))
    h.add("c", PROMPT, _params(max_tokens=5))
    h.run()
    assert h.finish["c"] == "length" and len(h.outputs["c"]) == 5
    s = h.scheduler
    assert s.requests == {} and s.blocks.num_free == s.blocks.num_usable


def test_a_result_that_does_not_fit_its_plan_ends_that_steps_requests(sim) -> None:
    h = _harness(sim)
    before = _bad_messages("core", "result_shape")
    h.add("a", PROMPT, _params(max_tokens=8))
    h.add("b", PROMPT, _params(max_tokens=8))
    broken = {}

    def short(k, result):
        if k == 4 and len(result.token_ids) == 2:  # a and b both decoding: one id short
            broken["seq"] = result.seq
            result.token_ids = result.token_ids[:1]
        return result

    _drive(h, short)
    assert broken, "the step was found"
    assert h.finish == {"a": "error", "b": "error"}
    assert all("impossible step result" in h.deltas[r][-1].error for r in ("a", "b"))
    assert _bad_messages("core", "result_shape") - before == 1
    h.add("c", PROMPT, _params(max_tokens=5))  # and the engine serves the next one
    h.run()
    assert h.finish["c"] == "length" and len(h.outputs["c"]) == 5
    s = h.scheduler
    assert s.requests == {} and s.blocks.num_free == s.blocks.num_usable
