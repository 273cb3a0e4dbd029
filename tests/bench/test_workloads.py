from __future__ import annotations

import json

import numpy as np
import pytest

from gapless.bench.datasets import read_loogle, read_sharegpt
from gapless.bench.workloads import build_workload, is_known, parse_fixed


def test_parse_fixed():
    assert parse_fixed("1024:64") == (1024, 64)
    assert parse_fixed(" 8 : 2 ") == (8, 2)
    assert parse_fixed("sharegpt") is None
    assert is_known("loogle") and is_known("3:1") and not is_known("1024x64")
    with pytest.raises(ValueError):
        parse_fixed("1:5")


@pytest.mark.parametrize("num_in", [2, 7, 32, 513])
def test_fixed_prompts_have_exact_lengths(maker, num_in):
    w = build_workload(f"{num_in}:5", maker, num_requests=6, seed=3)
    assert w.name == f"{num_in}:5" and w.synthetic and len(w.requests) == 6
    for r in w.requests:
        assert r.prompt_len == num_in and r.output_len == 5
        assert maker.count(r.prompt) == num_in
    assert len({r.prompt for r in w.requests}) == 6  # no shared prefixes from repeated prompts


def test_suffix_prompts_and_the_minimum(maker):
    rng = np.random.default_rng(0)
    text = maker.make(40, rng, suffix="\n\nQuestion: why?\nAnswer:")
    assert maker.count(text) == 40 and text.endswith("Answer:")
    with pytest.raises(ValueError):
        maker.make(maker.num_special, rng)


def test_seeded_repeatability(maker):
    a = build_workload("sharegpt", maker, num_requests=20, seed=7)
    b = build_workload("sharegpt", maker, num_requests=20, seed=7)
    c = build_workload("sharegpt", maker, num_requests=20, seed=8)
    assert a == b
    assert a.requests != c.requests


def test_sharegpt_synthetic_mix(maker):
    w = build_workload("sharegpt", maker, num_requests=400, seed=1)
    assert w.name == "sharegpt-synthetic" and w.synthetic
    assert 160 < w.mean_prompt_len < 240
    assert 145 < w.mean_output_len < 215
    lens = [r.prompt_len for r in w.requests]
    assert min(lens) < 80 and max(lens) > 500  # a spread, not one length
    assert all(maker.count(r.prompt) == r.prompt_len for r in w.requests[:50])


def test_sharegpt_synthetic_respects_the_context(maker):
    w = build_workload("sharegpt", maker, num_requests=200, seed=1, max_model_len=256)
    assert all(r.prompt_len + r.output_len <= 256 for r in w.requests)


def _sharegpt_file(tmp_path):
    data = [
        {
            "id": "a",
            "conversations": [
                {"from": "human", "value": "What is the capital of France? Tell me briefly."},
                {"from": "gpt", "value": "The capital of France is Paris, a large city."},
                {"from": "human", "value": "And of Spain?"},
            ],
        },
        {"id": "b", "conversations": [{"from": "gpt", "value": "no human turn first"}]},
        {
            "id": "c",
            "conversations": [
                {"from": "system", "value": "be nice"},
                {"from": "human", "value": "Write one sentence about queues and waiting."},
                {"from": "gpt", "value": "Queues teach patience to every one of us."},
            ],
        },
        {"id": "d", "conversations": []},
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    return path


def test_sharegpt_file(tmp_path, maker):
    path = _sharegpt_file(tmp_path)
    pairs = read_sharegpt(path)
    assert [p for p, _ in pairs] == [
        "What is the capital of France? Tell me briefly.",
        "Write one sentence about queues and waiting.",
    ]
    w = build_workload("sharegpt", maker, num_requests=5, seed=0, dataset=path)
    assert w.name == "sharegpt" and not w.synthetic and len(w.requests) == 5
    answers = {p: a for p, a in pairs}
    for r in w.requests:
        assert r.prompt_len == maker.count(r.prompt)
        assert r.output_len == maker.count(answers[r.prompt]) - maker.num_special


def test_sharegpt_file_without_pairs(tmp_path, maker):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps([{"conversations": [{"from": "gpt", "value": "x"}]}]))
    with pytest.raises(ValueError, match="human/gpt"):
        build_workload("sharegpt", maker, num_requests=2, dataset=path)


def test_loogle_synthetic_is_long_and_capped(maker):
    w = build_workload("loogle", maker, num_requests=4, seed=2, max_model_len=3000)
    assert w.name == "loogle-synthetic"
    for r in w.requests:
        assert 1500 < r.prompt_len and r.prompt_len + r.output_len <= 3000
        assert 16 <= r.output_len <= 100
        assert maker.count(r.prompt) == r.prompt_len
        assert r.prompt.rstrip().endswith("Answer:")


def test_loogle_file_is_cut_to_the_context(tmp_path, maker):
    doc = " ".join(["river"] * 3000)
    path = tmp_path / "loogle.jsonl"
    rows = [{"input": doc, "question": "Which word repeats?", "answer": "The word river repeats."}]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    assert len(read_loogle(path)) == 1
    w = build_workload("loogle", maker, num_requests=2, dataset=path, max_model_len=1000)
    r = w.requests[0]
    assert r.prompt_len + r.output_len <= 1000
    assert "Which word repeats?" in r.prompt


def test_prefix_workload_shares_one_system_prompt(maker):
    w = build_workload("prefix:64:5-9:7", maker, num_requests=12, seed=1)
    assert w.synthetic and len(w.requests) == 12 and is_known("prefix:64:5-9:7")
    system = w.requests[0].prompt.split(" ")[:64]
    for r in w.requests:
        assert r.prompt.split(" ")[:64] == system, "every prompt starts with the system prompt"
        assert 64 + 5 <= r.prompt_len <= 64 + 9 and maker.count(r.prompt) == r.prompt_len
        assert r.output_len == 7
    assert len({r.prompt for r in w.requests}) == 12, "the questions differ"
    for bad in ("prefix:64:5", "prefix:x:5:7", "prefix:64:9-5:7"):
        assert not is_known(bad)


def test_chat_workload_has_sessions_of_turns(maker):
    w = build_workload("chat:3:4:10:6:0.5", maker, num_requests=1, seed=1)
    assert len(w.requests) == 12 and w.think_s == 0.5
    assert [r.session for r in w.requests] == [s for s in range(3) for _ in range(4)]
    assert all(maker.count(r.prompt) == 10 and r.output_len == 6 for r in w.requests)
    assert (
        is_known("chat:3:4:10:6") and not is_known("chat:3:4") and not is_known("chat:3:4:10:6:-1")
    )
