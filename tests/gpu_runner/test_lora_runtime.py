"""LoRA adapters loaded and unloaded at run time, through the real core and cpu runner in one
process: a loaded adapter gives peft's greedy tokens; a bad one is refused with its reason and
loads nothing; unloading lets running requests finish and ends waiting ones with an error
naming the adapter; no step mixes more than --max-loras adapters; past --max-cpu-loras an
adapter is read again from disk when a request asks for it; a tenant's adapter requests keep
their fair share beside a tenant flooding the base."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from gapless.common.messages import (
    LoadLora,
    LoraAdapters,
    ReadAdapter,
    SamplingParams,
    StepPlan,
    UnloadLora,
)
from tests.engine_harness import Recorder, make_config
from tests.family_models import build
from tests.lora_adapters import make_adapter, scores

pytest.importorskip("peft")

PROMPT = [1, 2000, 3000, 4000, 5000, 6000, 7000]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def llama(tmp_path_factory, tiny_model_dir):
    """(model dir, adapters' root, {name: transformers + peft model}); adapters a and b, and
    broken copies of a: over the rank cap, DoRA, r that does not fit its tensors."""
    out = tmp_path_factory.mktemp("lora_runtime")
    base = build("llama", out / "model", tiny_model_dir)
    root = out / "adapters"
    refs = {"": base}
    for seed, name in enumerate(("a", "b")):
        refs[name] = make_adapter(base, "llama", root / name, "plain", seed)
    make_adapter(base, "llama", root / "wide", "rslora", 9)  # r=16
    for name, change in (("dora", {"use_dora": True}), ("misfit", {"r": 4})):
        shutil.copytree(root / "a", root / name)
        config = json.loads((root / name / "adapter_config.json").read_text())
        (root / name / "adapter_config.json").write_text(json.dumps({**config, **change}))
    return out / "model", root, refs


def _engine(model_dir, root, **overrides) -> Recorder:
    overrides = {"max_loras": 1, "max_num_seqs": 4, **overrides}
    return Recorder(make_config(model_dir, enable_lora=True, lora_dirs=(str(root),),
                                **overrides))  # fmt: skip


def _answers(h: Recorder) -> list[LoraAdapters]:
    return [m for m in h.frontend if isinstance(m, LoraAdapters) and m.token >= 0]


def _check_peft(h: Recorder, rid: str, ref) -> None:
    got = h.outputs[rid]
    assert len(got) == GREEDY.max_tokens, (rid, h.finish.get(rid))
    chosen, lps = scores(ref, PROMPT, got)
    assert got == chosen, rid
    torch.testing.assert_close(torch.tensor(h.logprobs[rid]), torch.tensor(lps), atol=1e-3, rtol=0)


def test_loaded_adapters_serve_bad_ones_load_nothing_and_steps_mix_at_most_max_loras(llama):
    """One engine (--max-loras 1, --max-cpu-loras 1) through a run: `a` loaded while its request
    waits, bad adapters refused, a taken name refused; then `b`, and requests of a, b and the
    base together: no step mixes two adapters, and each adapter let go from host memory is
    read again when its requests come."""
    model_dir, root, refs = llama
    h = _engine(model_dir, root, max_lora_rank=8, max_cpu_loras=1)
    reads = []
    handle = h.reader.handle
    h.reader.handle = lambda msg: (reads.append(msg), handle(msg))
    loads = [LoadLora(0, k, name, str(root / name))
             for k, name in enumerate(("a", "wide", "dora", "misfit"))]  # fmt: skip
    # the request of `a` arrives while `a` is read: it waits, then runs
    h.run({0: [("a/0", PROMPT, GREEDY, "", 0, None, "a"), ("base", PROMPT, GREEDY)]},
          messages={0: loads})  # fmt: skip
    _check_peft(h, "a/0", refs["a"])
    _check_peft(h, "base", refs[""])
    answers = {a.token: a for a in _answers(h)}
    assert answers[0].error == "" and answers[0].names == ["a"]
    assert "rank 16 is over --max-lora-rank 8" in answers[1].error
    assert "use_dora=True is not supported" in answers[2].error
    assert "do not fit r=4" in answers[3].error
    assert all(answers[k].status == 400 for k in (1, 2, 3))
    load_b = [LoadLora(0, 9, "a", str(root / "b")), LoadLora(0, 10, "b", str(root / "b"))]
    h.run(messages={h.steps: load_b})
    taken, loaded = _answers(h)[-2:]
    assert taken.token == 9 and taken.status == 400 and "loaded already" in taken.error
    assert loaded.token == 10 and loaded.names == ["a", "b"]
    mixes = []
    launch = h.backend.launch

    def recorded(plan: StepPlan):
        handle = launch(plan)
        stack = h.backend.executor.lora
        mixes.append({stack.names[stack.slot_adapter[s]] for s in plan.slots} - {None})
        return handle

    h.backend.launch = recorded
    del reads[:]
    h.run({h.steps: [(f"{n}/{i}", PROMPT, GREEDY, "", 0, None, n) for i in (1, 2)
                     for n in ("a", "b", "")]})  # fmt: skip
    assert max(len(m) for m in mixes) == 1 and {"a", "b"} <= set().union(*mixes)
    assert [m.name for m in reads if isinstance(m, ReadAdapter)] == ["a"], "b was in memory"
    assert len(h.backend.executor.lora.host) == 1
    for rid in h.outputs:  # "base" and "/1": the base model's
        _check_peft(h, rid, refs[rid.split("/")[0].replace("base", "")])


def test_unload_lets_running_requests_finish_and_ends_waiting_ones(llama):
    model_dir, root, refs = llama
    h = _engine(model_dir, root, lora_modules={"a": str(root / "a")}, max_num_seqs=1)
    arrivals = {0: [(f"a/{i}", PROMPT, GREEDY, "", 0, None, "a") for i in range(3)]}
    h.run(arrivals, messages={3: [UnloadLora(0, 5, "a")]})
    _check_peft(h, "a/0", refs["a"])  # it ran when the adapter went
    for rid in ("a/1", "a/2"):
        assert h.finish[rid] == "error" and h.outputs[rid] == []
        assert "'a' unloaded" in h.deltas[rid][-1].error
    assert _answers(h)[-1].names == [] and _answers(h)[-1].token == 5
    h.run(messages={h.steps: [UnloadLora(0, 6, "a")]})
    assert _answers(h)[-1].status == 404


def test_an_adapter_tenant_keeps_its_share_beside_a_base_flood(llama):
    """Fair share across adapters: tenant A's requests name its adapter, tenant B floods the
    base; while both wait for seats each receives half the tokens (time in engine steps)."""
    model_dir, root, _ = llama
    h = _engine(
        model_dir,
        root,
        lora_modules={"a": str(root / "a")},
        scheduling_policy="fair",
        priority_aging_s=1e6,
    )  # why: the order must not hang on how slow the host is
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    flood = [(f"B{i}", PROMPT, params, "B") for i in range(16)]
    mine = [(f"A{i}", PROMPT, params, "A", 0, None, "a") for i in range(6)]
    h.run({0: flood + mine})  # the flood first in line
    both = [k for k, waiting in enumerate(h.backlogged) if {"A", "B"} <= waiting]
    first, last = both[0], both[-1] + 1
    assert last - first >= 20, "a window long enough to measure"
    got = {t: sum(first <= s < last for rid, steps in h.token_steps.items() if rid[0] == t
                  for s in steps) for t in "AB"}  # fmt: skip
    assert 0.9 <= got["A"] / got["B"] <= 1.1, got  # first come first served: A gets none
    assert all(len(h.outputs[f"A{i}"]) == 10 for i in range(6))
