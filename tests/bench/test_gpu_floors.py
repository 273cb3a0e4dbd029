"""The GPU check's floor arithmetic: the bytes and FLOPs of a step over a card's bandwidth and
peak, checked against hand counts, the model's own parameters and the issue's figures."""

from __future__ import annotations

import random

import pytest
import torch

from gapless.bench.gpu_check import floors
from gapless.bench.gpu_check.floors import Entry, card, keys_attended, model_params, step_cost
from gapless.bench.gpu_check.shapes import SHAPES
from gapless.common.families import FAMILIES
from gapless.gpu_runner.model import CausalLM
from gapless.gpu_runner.sim.profiles import llama_params

LLAMA3_8B = SHAPES["llama3-8b"].arch()
LLAMA3_1B = SHAPES["llama3.2-1b"].arch()
H200 = 4.8e12  # bytes/s, the issue's


@pytest.mark.parametrize("name", list(SHAPES))
def test_model_params_count_what_the_model_holds(name):
    arch = SHAPES[name].arch()
    with torch.device("meta"):
        model = CausalLM(arch)
    held = sum(p.numel() for p in model.parameters())  # a tied embedding once
    assert model_params(arch) == held


def test_llama_counts_match_the_published_sizes():
    assert model_params(LLAMA3_8B) == llama_params(128256, 4096, 32, 32, 8, 128, 14336)
    assert model_params(LLAMA3_8B) == 8_030_261_248  # Meta-Llama-3-8B's 8.03B
    assert model_params(LLAMA3_1B) == llama_params(128256, 2048, 16, 32, 8, 64, 8192, tied=True)


def test_the_issues_decode_floors():
    # 8B at batch 256, context 1,250: 15.0 GB of weights, 41.9 GB of K/V: 11.9 ms at 4.8 TB/s
    cost = step_cost(LLAMA3_8B, floors.decode_entries(256, 1250))
    h, v = 4096, 128256
    assert cost.weight_bytes == 2 * (model_params(LLAMA3_8B) - v * h + 256 * h)
    per_token = 2 * 32 * 8 * 128 * 2  # K and V, 32 layers, 8 heads of 128, bf16: 128 KiB
    assert cost.kv_read_bytes == 256 * 1250 * per_token
    assert cost.kv_write_bytes == 256 * per_token
    f = floors.floors(cost, H200, 989.4e12)
    assert f.bound == "memory" and f.hbm_s == pytest.approx(11.87e-3, rel=0.01)
    # 1B at batch 128, context 640: the tied table is read once as the LM head: ~1.1 ms
    cost = step_cost(LLAMA3_1B, floors.decode_entries(128, 640))
    assert cost.kv_read_bytes == 128 * 640 * 2 * 16 * 8 * 64 * 2
    assert floors.floors(cost, H200, 989.4e12).hbm_s == pytest.approx(1.07e-3, rel=0.02)


def test_flops_count_matmuls_per_token_and_the_lm_head_per_sampled_row():
    arch = LLAMA3_8B
    h, v, d = 4096, 128256, 128
    per_token = 32 * (h * (32 * d + 2 * 8 * d) + 32 * d * h + 3 * h * 14336)
    decode = step_cost(arch, floors.decode_entries(4, 100))
    attention = 32 * 4 * 32 * d * 4 * 100  # layers, heads, head dim, 4 per key, 4 x 100 keys
    assert decode.flops == 2 * 4 * per_token + 2 * v * h * 4 + attention
    prompt = step_cost(arch, [Entry(8, 8, sampled=False), Entry(8, 8)])
    keys = 2 * (8 * 9 // 2)  # causal: 1 + 2 + ... + 8 keys per chunk
    assert prompt.flops == 2 * 16 * per_token + 2 * v * h * 1 + 32 * 32 * d * 4 * keys


def test_keys_attended_and_read_agree_with_counting():
    rng = random.Random(0)
    for _ in range(300):
        n, ctx = rng.randint(1, 40), rng.randint(40, 120)
        window = rng.choice([0, 1, 5, 17, 64, 500])
        positions = range(ctx - n, ctx)  # the chunk's queries, 0-based
        seen = [min(p + 1, window) if window else p + 1 for p in positions]
        assert keys_attended(n, ctx, window) == sum(seen)
        first = min(p - s + 1 for p, s in zip(positions, seen, strict=True))
        assert floors.keys_read(n, ctx, window) == ctx - first


def test_windows_cap_what_a_sliding_layer_reads():
    arch = SHAPES["mistral-7b"].arch()  # a 4096-key window on every layer
    short = step_cost(arch, floors.decode_entries(2, 1000))
    long = step_cost(arch, floors.decode_entries(2, 6000))
    capped = step_cost(arch, floors.decode_entries(2, 4096))
    assert long.kv_read_bytes == capped.kv_read_bytes > short.kv_read_bytes


def test_routed_experts_are_read_as_tokens_pick_them():
    arch = SHAPES["mixtral-8x7b"].arch()  # 8 experts, top 2
    assert floors.expected_experts(8, 2, 1) == 2
    assert floors.expected_experts(8, 2, 1000) == pytest.approx(8)
    one = step_cost(arch, floors.decode_entries(1, 10))
    many = step_cost(arch, floors.decode_entries(256, 10))
    expert = 3 * 4096 * 14336
    assert many.weight_bytes - one.weight_bytes == pytest.approx(
        2 * (arch.num_layers * 6 * expert + 255 * 4096), rel=1e-6
    )  # every expert read at batch 256 against two at batch 1 (and 255 more embedding rows)


def test_cards_by_name():
    assert card("NVIDIA H200").hbm_bandwidth == 4.8e12
    assert card("NVIDIA H100 80GB HBM3").hbm_bandwidth == 3.35e12
    assert card("NVIDIA H100 PCIe").hbm_bandwidth == 2.0e12
    assert card("NVIDIA A100-SXM4-80GB").bf16_peak == 312e12
    unknown = card("NVIDIA GeForce RTX 3090")
    assert unknown.hbm_bandwidth is None and unknown.bf16_peak is None
    assert floors.ratio(22.0, 11.0) == 2.0 and floors.ratio(None, 11.0) is None


def test_every_family_has_a_shape():
    assert {s.family for s in SHAPES.values()} == {f.name for f in FAMILIES}
