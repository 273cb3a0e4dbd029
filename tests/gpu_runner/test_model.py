"""The paged model against Hugging Face transformers on the same random weights."""

from __future__ import annotations

import pytest
import torch

from gapless.common.messages import NewSlot, SamplingParams, StepPlan
from gapless.common.model_files import ModelArch
from gapless.gpu_runner.batch import (
    IDS,
    LOGIT_ROWS,
    POSITIONS,
    SLOT_MAPPING,
    TOK_SLOT,
    PersistentBatch,
)
from gapless.gpu_runner.cpu import kernels
from gapless.gpu_runner.cpu.attention import TorchAttention
from gapless.gpu_runner.model import CausalLM

transformers = pytest.importorskip("transformers")

BS = 4  # small blocks so a sequence spans several


@pytest.fixture(scope="module")
def pair():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    )
    ref = transformers.LlamaForCausalLM(cfg).eval()
    arch = ModelArch(
        architecture="llama",
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rope_theta=10000.0,
        rms_norm_eps=cfg.rms_norm_eps,
        max_position=256,
        tie_word_embeddings=False,
        attention_bias=False,
    )
    ours = CausalLM(arch)
    ours.load({k: v.clone() for k, v in ref.state_dict().items()})
    return ref, ours.eval(), arch


def _step(batch, model, kv, entries, seq, new=(), kernel=False):
    """entries: (slot, start, token ids or None for last_token, sample)."""
    plan = StepPlan(
        seq=seq,
        new_slots=[
            NewSlot(slot=s, params=SamplingParams(max_tokens=1), num_prompt_tokens=0) for s in new
        ],
        freed_slots=[],
        slots=[e[0] for e in entries],
        num_tokens=[len(e[2]) if e[2] is not None else 1 for e in entries],
        start_pos=[e[1] for e in entries],
        has_tokens=[e[2] is not None for e in entries],
        token_ids=[t for e in entries if e[2] is not None for t in e[2]],
        sample=[e[3] for e in entries],
        num_new_blocks=[],
        new_blocks=[],
    )
    # hand out blocks so every entry's context fits: slot s owns blocks s*16+1 ..
    nb, blocks = [], []
    for slot, start, ids, _ in entries:
        end = start + (len(ids) if ids is not None else 1)
        have = int(batch.num_blocks[slot]) + sum(
            n for n, e in zip(nb, entries, strict=False) if e[0] == slot
        )
        need = max(0, -(-end // BS) - have)
        nb.append(need)
        blocks.extend(slot * 16 + 1 + have + i for i in range(need))
    plan.num_new_blocks, plan.new_blocks = nb, blocks
    for s in new:
        batch.add(s)
    inp = batch.prepare(plan, pad=True)
    rows = inp.num_rows
    meta = TorchAttention(8, 64 * BS, BS, 16**-0.5, kernel).build(
        inp.layout, batch.column(SLOT_MAPPING, rows)
    )
    fed = batch.column(IDS, rows)
    ids = torch.where(fed >= 0, fed, batch.last_token[batch.column(TOK_SLOT, rows)])
    logit_rows = batch.column(LOGIT_ROWS, inp.num_sample)
    with torch.inference_mode():
        return model(ids, batch.column(POSITIONS, rows), kv, meta, logit_rows)


@pytest.mark.parametrize("kernel", [False, True], ids=["torch", "kernel"])
def test_prefill_chunks_and_decodes_match_transformers(pair, kernel):
    if kernel and not kernels.available(torch.float32):
        pytest.skip("no C++ compiler for the paged kernel")
    ref, model, arch = pair
    torch.manual_seed(1)
    a = torch.randint(0, 128, (13,)).tolist()
    b = torch.randint(0, 128, (6,)).tolist()
    batch = PersistentBatch(4, 64, BS, 32, "cpu")
    kv = torch.zeros(2, 2, 80 * BS, 2, 16)
    # step 1: a's first chunk (7) alone; step 2: a's second chunk (6) with b's whole prompt
    _step(batch, model, kv, [(0, 0, a[:7], False)], 1, new=[0], kernel=kernel)
    got = _step(batch, model, kv, [(0, 7, a[7:], True), (1, 0, b, True)], 2, new=[1], kernel=kernel)
    with torch.no_grad():
        want_a = ref(torch.tensor([a])).logits[0, -1]
        want_b = ref(torch.tensor([b])).logits[0, -1]
    torch.testing.assert_close(got[0], want_a, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got[1], want_b, atol=1e-4, rtol=1e-4)
    # decodes fed from last_token on the device, batched with different context lengths
    batch.last_token[0], batch.last_token[1] = 5, 9
    got = _step(batch, model, kv, [(0, 13, None, True), (1, 6, None, True)], 3, kernel=kernel)
    with torch.no_grad():
        want_a = ref(torch.tensor([a + [5]])).logits[0, -1]
        want_b = ref(torch.tensor([b + [9]])).logits[0, -1]
    torch.testing.assert_close(got[0], want_a, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got[1], want_b, atol=1e-4, rtol=1e-4)
    # a decode in the same step as a new prompt: the mixed step's decode rows
    c = torch.randint(0, 128, (5,)).tolist()
    batch.last_token[0] = 7
    got = _step(batch, model, kv, [(0, 14, None, True), (2, 0, c, True)], 4, new=[2], kernel=kernel)
    with torch.no_grad():
        want_a = ref(torch.tensor([a + [5, 7]])).logits[0, -1]
        want_c = ref(torch.tensor([c])).logits[0, -1]
    torch.testing.assert_close(got[0], want_a, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got[1], want_c, atol=1e-4, rtol=1e-4)


def test_llama3_rope_scaling_matches_transformers():
    from gapless.gpu_runner.model import rope_inv_freq

    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    cfg = transformers.LlamaConfig(
        hidden_size=64,
        num_attention_heads=4,
        rope_theta=500000.0,
        max_position_embeddings=512,
        rope_scaling=scaling,
    )
    rot = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(cfg)
    arch = ModelArch(
        architecture="llama",
        vocab_size=8,
        hidden_size=64,
        intermediate_size=8,
        num_layers=1,
        num_heads=4,
        num_kv_heads=4,
        head_dim=16,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        max_position=512,
        tie_word_embeddings=True,
        attention_bias=False,
        rope_scaling={k: v for k, v in scaling.items()},
    )
    torch.testing.assert_close(rope_inv_freq(arch), rot.inv_freq.float(), atol=1e-7, rtol=1e-5)


ROPES = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
    "yarn-mscale": {
        "rope_type": "yarn",
        "factor": 8.0,
        "original_max_position_embeddings": 64,
        "mscale": 0.707,
        "mscale_all_dim": 1.0,
        "beta_fast": 16.0,
    },  # fmt: skip
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },  # fmt: skip
    "longrope": {
        "rope_type": "longrope",
        "short_factor": [1.0 + 0.1 * i for i in range(8)],
        "long_factor": [2.0 + 0.5 * i for i in range(8)],
        "original_max_position_embeddings": 64,
    },  # fmt: skip
}


@pytest.mark.parametrize("kind", list(ROPES))
def test_every_rope_kind_turns_as_transformers(kind):
    """cos and sin of each RoPE kind at every position of the context, as transformers'
    rotary embedding gives them (LongRoPE: one position at a time past the original
    context, as a decode step asks)."""
    from gapless.common.families import arch_from_config
    from gapless.gpu_runner.model import Rope

    params = {**ROPES[kind], "rope_theta": 50000.0}
    cfg = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=1,
                                   max_position_embeddings=256, rope_parameters=params)  # fmt: skip
    rot = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(cfg)
    arch = arch_from_config({**cfg.to_dict(), "model_type": "llama"}, "test")
    rope = Rope(arch, arch.rope_theta, arch.rope_scaling)
    x = torch.zeros(1, dtype=torch.float32)
    short = torch.arange(64)
    want_cos, want_sin = rot(x, short[None])
    cos, sin = rope(short)
    torch.testing.assert_close(cos, want_cos[0], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(sin, want_sin[0], atol=1e-6, rtol=1e-5)
    for p in (64, 100, 255):  # one decode position at a time, past any original context
        want_cos, want_sin = rot(x, torch.tensor([[p]]))
        cos, sin = rope(torch.tensor([p]))
        torch.testing.assert_close(cos, want_cos[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(sin, want_sin[0], atol=1e-5, rtol=1e-5)


def test_gguf_rope_factors_divide_the_frequencies_as_llama3s():
    """llama.cpp writes llama3's scaling as per-frequency divisors (rope_freqs): the same
    frequencies as the scaling computed from config.json's keys."""
    from gapless.common.families import arch_from_config
    from gapless.gpu_runner.model import Rope

    params = {**ROPES["llama3"], "rope_theta": 50000.0}
    cfg = dict(model_type="llama", hidden_size=64, num_attention_heads=4, num_hidden_layers=1,
               vocab_size=8, max_position_embeddings=256, rope_parameters=params)  # fmt: skip
    arch = arch_from_config(cfg, "test")
    plain = Rope(arch, arch.rope_theta, None).inv
    scaled = Rope(arch, arch.rope_theta, arch.rope_scaling).inv
    factors = {"rope_type": "factors", "factors": (plain / scaled).tolist()}
    torch.testing.assert_close(Rope(arch, arch.rope_theta, factors).inv, scaled)
    assert not torch.allclose(plain, scaled)
