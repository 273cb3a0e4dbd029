"""Requests whose LoRA adapter may not take a seat yet (its weights still being read, or the
running set already using --max-loras adapters) wait aside: the requests behind them run,
their tenant is charged nothing meanwhile, and they keep their place in line."""

from __future__ import annotations

import time

from gapless.common.messages import AddRequest, SamplingParams
from gapless.core.policy import FairPolicy
from tests.core.test_scheduler import fake_result, make_scheduler


def _add(s, rid: str, tenant: str, lora: str = ""):
    return s.add_request(AddRequest(request_id=rid, frontend_id=0, tenant=tenant, lora=lora,
                                    prompt_token_ids=[hash(rid) % 1000 + 100, 11, 12, 13, 14],
                                    params=SamplingParams(max_tokens=4),
                                    arrival_time=time.time()))  # fmt: skip


def _run(s, step):
    s.update_from_output(step, fake_result(step))


def test_a_request_whose_adapter_is_read_waits_aside_uncharged():
    s = make_scheduler(policy=FairPolicy(), max_loras=1, max_num_seqs=2)
    first = _add(s, "x0", "acme", lora="x")
    later = [_add(s, f"b{i}", "beta") for i in range(2)]
    step = s.schedule()
    assert {r.request_id for r in step.rows.requests} == {"b0", "b1"}  # not held behind x0
    assert s.num_waiting == 1 and not first.started
    acme = s.policy.tenant_id("acme")
    assert s.policy.prompt_tokens[acme] == 0 and s.policy.counters[acme] == 0
    _run(s, step)
    for req in later:
        s.finish(req, "abort")
    s.lora.add_ready("x")  # the runner read it
    step = s.schedule()
    assert [r.request_id for r in step.rows.requests] == ["x0"]
    assert s.policy.prompt_tokens[acme] == 5


def test_a_further_adapter_waits_for_a_seat_without_holding_the_queue():
    s = make_scheduler(max_loras=1, lora_ready=("x", "y"), max_num_seqs=4)
    x, y, base = _add(s, "x", "t", "x"), _add(s, "y", "t", "y"), _add(s, "base", "t")
    step = s.schedule()
    assert [r.request_id for r in step.rows.requests] == ["x", "base"]
    x2 = _add(s, "x2", "t", "x")
    _run(s, step)
    step = s.schedule()
    assert "x2" in {r.request_id for r in step.rows.requests} and not y.started
    _run(s, step)
    s.finish(x, "abort")
    s.finish(x2, "abort")
    step = s.schedule()  # x's seats are gone: y's adapter may take one
    assert "y" in {r.request_id for r in step.rows.requests}
    assert s.lora.running == {"y": 1}
    s.finish(y, "abort")
    s.finish(base, "abort")
    assert not s.has_work and s.num_waiting == 0


def test_a_request_waiting_for_its_adapter_meets_the_queue_deadline(default_gguf):
    """--max-queue-wait ends a request waiting aside for its adapter's read as any other."""
    from gapless.common.messages import LoadLora, TokenBatch
    from gapless.core.engine import EngineCore
    from tests.conftest import sim_config

    config = sim_config(default_gguf, enable_lora=True, max_queue_wait_s=0.001)
    core = EngineCore(config, num_kv_blocks=64)
    core.handle(LoadLora(0, 1, "x", "/adapters/x"))  # read by no runner here: it never ends
    core.handle(AddRequest(request_id="r", frontend_id=0, prompt_token_ids=[5, 6, 7],
                           params=SamplingParams(max_tokens=2), arrival_time=time.time(),
                           lora="x"))  # fmt: skip
    core.step()
    assert core.scheduler.lora.num_held == 1
    time.sleep(0.05)  # why: past the deadline, however fast the host
    out = core.step()
    (batch,) = [m for m in out.detok if isinstance(m, TokenBatch)]
    assert batch.request_ids == ["r"] and batch.finish_reasons == ["queue_timeout"]
    assert core.scheduler.num_waiting == 0
