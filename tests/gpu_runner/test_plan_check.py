"""The runner's boundary (gpu_runner/plan_check.py): every plan the real scheduler makes passes;
a plan the batch could not run is counted and dropped before it changes anything, in the check
and in the runner's real process loop, which goes on running the next plan."""

from __future__ import annotations

import threading
from collections import deque

import msgspec
import pytest
import zmq
from prometheus_client import REGISTRY

from gapless.common.channel import Receiver, Sender
from gapless.common.config import EngineConfig, ModelInfo
from gapless.common.messages import (
    ControlMessage,
    NewSlot,
    Ready,
    RunnerInput,
    RunnerOutput,
    RunnerReady,
    SamplingParams,
    Shutdown,
    StepPlan,
    StepRefused,
    StepResult,
)
from gapless.common.process import CONTROL, RUNNER_IN, RUNNER_OUT
from gapless.gpu_runner import process
from gapless.gpu_runner.plan_check import PlanCheck
from gapless.gpu_runner.sim.backend import SimBackend
from tests.conftest import sim_config
from tests.engine_harness import Harness
from tests.gpu_runner.test_bench_prepare import BLOCK, MAX_MODEL_LEN, steady

PROMPT = list(range(1000, 1040))  # 40 tokens


@pytest.fixture(scope="module")
def config(default_gguf):
    return sim_config(default_gguf, max_num_seqs=4, max_num_batched_tokens=64, seed=3)


def _bad(reason: str) -> float:
    labels = {"process": "gpu_runner", "reason": reason}
    return REGISTRY.get_sample_value("gapless_bad_messages_total", labels) or 0.0


def test_every_plan_of_the_scheduler_passes(config) -> None:
    """Chunked prefill, preemption (a small cache), prompt logprobs, penalties over a cached
    prefix, aborts: each plan passes the check and runs."""
    sim = SimBackend(config)
    sim.num_blocks = 9  # 8 usable: two of these requests at a time
    h = Harness(config, backend=sim)
    check = PlanCheck(config, sim.batch, sim.num_blocks)
    launch, seen = sim.launch, []

    def checked(plan: StepPlan):
        assert check.problem(plan) is None, plan
        check.accept(plan)
        seen.append(plan)
        return launch(plan)

    sim.launch = checked  # type: ignore[method-assign]
    long, scored = SamplingParams(max_tokens=40), SamplingParams(max_tokens=8, prompt_logprobs=2)
    penalised = SamplingParams(max_tokens=8, repetition_penalty=1.3)
    h.run(
        {
            0: [("a", PROMPT, long), ("b", PROMPT, long), ("c", PROMPT, long)],
            2: [("scored", PROMPT, scored), ("gone", list(range(60)), long)],
            30: [("penalised", PROMPT, penalised)],
        },
        aborts={5: ["gone"]},
    )
    assert h.scheduler.num_preemptions > 0 and len(seen) > 50
    assert check.last_seq == seen[-1].seq
    assert h.finish == dict.fromkeys(["a", "b", "c", "scored", "penalised"], "length") | {
        "gone": "abort"
    }


def _plan(seq: int, **fields) -> StepPlan:
    empty = dict(new_slots=[], freed_slots=[], slots=[], num_tokens=[], start_pos=[])
    lists = dict(has_tokens=[], token_ids=[], sample=[], num_new_blocks=[], new_blocks=[])
    return StepPlan(seq=seq, **{**empty, **lists, **fields})


def _new(slot: int, **params) -> NewSlot:
    return NewSlot(slot, SamplingParams(**{"max_tokens": 4, **params}), num_prompt_tokens=16)


def _prefill(seq: int, slot: int = 0, **fields) -> StepPlan:
    """Slot `slot` takes a 16-token prompt in one block and samples."""
    base = dict(
        new_slots=[_new(slot)],
        slots=[slot],
        num_tokens=[16],
        start_pos=[0],
        has_tokens=[True],
        token_ids=list(range(100, 116)),
        sample=[True],
        num_new_blocks=[1],
        new_blocks=[3],
    )
    return _plan(seq, **{**base, **fields})


def _decode(seq: int, slots: list[int], start: int, **fields) -> StepPlan:
    b = len(slots)
    base = dict(
        slots=slots,
        num_tokens=[1] * b,
        start_pos=[start] * b,
        has_tokens=[False] * b,
        sample=[True] * b,
        num_new_blocks=[0] * b,
    )
    return _plan(seq, **{**base, **fields})


# (case, plan after plan 1 put slot 0 in use with one block, reason)
IMPOSSIBLE_PLANS = [
    ("replayed", _decode(1, [0], 16), "plan_out_of_order"),
    ("skips-ahead", _decode(3, [0], 16), "plan_out_of_order"),
    ("short-list", _decode(2, [0], 16, sample=[]), "plan_shape"),
    ("unknown-slot", _decode(2, [2], 0), "plan_slots"),
    ("slot-out-of-range", _decode(2, [99], 0), "plan_slots"),
    ("negative-slot", _decode(2, [-1], 0), "plan_slots"),
    ("slot-twice", _decode(2, [0, 0], 15), "plan_slots"),
    ("frees-a-free-slot", _decode(2, [0], 15, freed_slots=[1]), "plan_slots"),
    ("adds-a-held-slot", _prefill(2, slot=0, new_blocks=[4]), "plan_slots"),
    ("new-slot-params", _prefill(2, slot=1, new_slots=[_new(1, top_p=0.0)]), "plan_slots"),
    ("ids-past-vocab", _prefill(2, slot=1, token_ids=[10**6] * 16), "plan_tokens"),
    ("ids-missing", _prefill(2, slot=1, token_ids=[5]), "plan_tokens"),
    ("fed-entry-no-ids", _decode(2, [0], 15, has_tokens=[True]), "plan_tokens"),
    ("too-many-tokens", _prefill(2, slot=1, num_tokens=[10**6]), "plan_tokens"),
    ("reserved-block", _prefill(2, slot=1, new_blocks=[0]), "plan_blocks"),
    ("block-past-pool", _prefill(2, slot=1, new_blocks=[10**6]), "plan_blocks"),
    ("blocks-miscounted", _decode(2, [0], 15, num_new_blocks=[2], new_blocks=[4]), "plan_blocks"),
    ("past-block-table", _decode(2, [0], 15, num_new_blocks=[10**4]), "plan_blocks"),
    ("past-its-blocks", _decode(2, [0], 16), "plan_positions"),
    ("negative-position", _decode(2, [0], -3), "plan_positions"),
]


@pytest.mark.parametrize(
    "plan, reason", [c[1:] for c in IMPOSSIBLE_PLANS], ids=[c[0] for c in IMPOSSIBLE_PLANS]
)
def test_an_impossible_plan_is_dropped_and_changes_nothing(config, plan, reason) -> None:
    sim = SimBackend(config)
    check = PlanCheck(config, sim.batch, sim.num_blocks)
    first = _prefill(1)
    assert check.accept(first)
    sim.collect(sim.launch(first))
    if reason == "plan_blocks" and plan.num_new_blocks == [10**4]:
        plan.new_blocks = [4] * 10**4
    active, blocks = sim.batch.active.copy(), sim.batch.num_blocks.copy()
    before = _bad(reason)
    assert not check.accept(plan)
    assert _bad(reason) - before == 1
    assert (sim.batch.active == active).all() and (sim.batch.num_blocks == blocks).all()
    # a refused plan next in line moves the sequence on (the core failed its step); one out
    # of order does not
    assert check.last_seq == (2 if plan.seq == 2 else 1)
    nxt = _decode(check.last_seq + 1, [0], 15)  # the next good plan runs
    assert check.accept(nxt)
    assert len(sim.collect(sim.launch(nxt)).token_ids) == 1


def test_the_runner_loop_drops_impossible_plans_and_runs_the_next(config, tmp_path) -> None:
    cfg = msgspec.structs.replace(config, run_dir=str(tmp_path))
    ctx = zmq.Context()
    control = Receiver(ctx, cfg.ipc(CONTROL), ControlMessage)
    results: Receiver[RunnerOutput] = Receiver(ctx, cfg.ipc(RUNNER_OUT), RunnerOutput)
    thread = threading.Thread(target=process.run_gpu_runner, args=(cfg,), daemon=True)
    thread.start()
    plans: Sender[RunnerInput] | None = None
    before = _bad("plan_slots") + _bad("plan_out_of_order")
    try:
        assert isinstance(results.recv(timeout_ms=60_000), RunnerReady)
        ready = control.recv(timeout_ms=5_000)
        assert isinstance(ready, Ready) and ready.role == "gpu_runner"
        plans = Sender(ctx, cfg.ipc(RUNNER_IN))
        # before: an IndexError (slot 99) or the out-of-order assert ended the runner; each
        # refusal in sequence now takes its step's place in line, so the core ends that step's
        # requests; one out of sequence (7) is counted and not answered: no core awaits it
        for bad in (_decode(1, [99], 0), _decode(7, [0], 0), _decode(2, [0, 0], 0)):
            plans.send(bad)
        for seq in (1, 2):
            refused = results.recv(timeout_ms=10_000)
            assert isinstance(refused, StepRefused) and refused.seq == seq, refused
        got: deque = deque()
        for plan in (_prefill(3), _decode(4, [0], 16, num_new_blocks=[1], new_blocks=[4])):
            plans.send(plan)
            msg = results.recv(timeout_ms=10_000)
            assert isinstance(msg, StepResult), msg
            got.append(msg)
        assert [(r.seq, len(r.token_ids)) for r in got] == [(3, 1), (4, 1)]
        assert _bad("plan_slots") + _bad("plan_out_of_order") - before == 3
        plans.send(Shutdown())
        thread.join(timeout=10)
        assert not thread.is_alive()
    finally:
        for socket in (control, results, *([plans] if plans else [])):
            socket.close()
        ctx.term()


@pytest.mark.parametrize("batch", [1, 32, 256])
def test_bench_plan_check_decode(benchmark, batch):
    """The check's cost per steady-decode plan; test_bench_prepare.py's decode is the same plan
    prepared (`pytest tests/gpu_runner -k "bench_plan_check or bench_prepare_decode"
    --benchmark-enable`)."""
    pb, _, plan = steady(batch)
    model = ModelInfo(
        path="unused",
        architecture="llama",
        vocab_size=49152,
        max_model_len=MAX_MODEL_LEN,
        eos_token_ids=(2,),
    )
    config = EngineConfig(model=model, served_model_name="x", max_num_seqs=batch)
    check = PlanCheck(config, pb, num_blocks=batch * MAX_MODEL_LEN // BLOCK + 1)
    assert check.problem(plan) is None  # the slots are now the last plan's

    def fresh():  # why: each plan arrives as new lists, compared element by element
        lists = {f: list(getattr(plan, f)) for f in ("slots", "start_pos", "num_tokens")}
        return (msgspec.structs.replace(plan, **lists),), {}

    problem = benchmark.pedantic(check.problem, setup=fresh, rounds=500)
    assert problem is None
    late = msgspec.structs.replace(plan, start_pos=[p + BLOCK for p in plan.start_pos])
    assert check.problem(late) == (
        "plan_positions",
        "an entry's positions outside its slot's blocks",
    )
