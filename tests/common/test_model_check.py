"""Hostile model files refused from their headers (common/model_check.py), before anything is
built: each refusal names the file and the field, and one that claims a million heads,
layers or experts costs what its few-hundred-kilobyte file costs to read."""

from __future__ import annotations

import math
import re
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import pytest

from gapless.common.model_check import check_model
from tests.hostile_models import cut, set_gguf_alignment, set_gguf_version, write_gguf, write_hf

pytest.importorskip("gguf")

BIG = 10**6
NAN = math.nan
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}  # fmt: skip
LONGROPE = {"type": "longrope", "short_factor": [1.0] * 3, "long_factor": [2.0] * 8}


def _syntax_error(path: Path) -> Path:
    write_hf(path)
    (path / "config.json").write_text('{"model_type": "llama", "hidden_size": 64,,}')
    return path


def _cut_safetensors(path: Path) -> Path:
    write_hf(path)
    cut(path / "model.safetensors", -100)
    return path


def _gguf(**metadata) -> Callable[[Path], Path]:
    return lambda path: write_gguf(path / "m.gguf", **metadata)


# case -> (writes the model under a folder, what the refusal says: the file, then the field)
HF_CASES: dict[str, tuple[Callable[[Path], Path], str]] = {  # a Llama (Mixtral's with experts)
    "heads 10^6": (lambda p: write_hf(p, num_attention_heads=BIG),
                   "config.json: num_attention_heads 1000000 does not divide"),
    "heads 10^6, head_dim given": (lambda p: write_hf(p, num_attention_heads=BIG, head_dim=16),
                                   "model.safetensors: tensor 'model.layers.0.self_attn.q_proj"
                                   ".weight' is \\[64, 64\\], but num_attention_heads 1000000"),
    "layers 10^6": (lambda p: write_hf(p, num_hidden_layers=BIG),
                    "config.json: num_hidden_layers 1000000: the safetensors hold 2 layers"),
    "experts 10^6": (lambda p: write_hf(p, experts=True, num_local_experts=BIG),
                     "config.json: num_local_experts 1000000: the safetensors hold 4 experts"),
    "heads 0": (lambda p: write_hf(p, num_attention_heads=0), "config.json: num_attention_heads 0"),
    "layers 0": (lambda p: write_hf(p, num_hidden_layers=0), "config.json: num_hidden_layers 0"),
    "kv heads that do not divide": (lambda p: write_hf(p, num_key_value_heads=3),
                                    "config.json: num_key_value_heads 3 does not divide"),
    "rope_theta 0": (lambda p: write_hf(p, rope_theta=0.0), "config.json: rope_theta 0.0"),
    "rope_theta NaN": (lambda p: write_hf(p, rope_theta=NAN), "config.json: rope_theta nan"),
    "rope factor 0": (lambda p: write_hf(p, rope_scaling={"type": "linear", "factor": 0}),
                      "config.json: rope_scaling.factor 0.0"),
    "rope factor NaN": (lambda p: write_hf(p, rope_scaling={"type": "linear", "factor": NAN}),
                        "config.json: rope_scaling.factor nan"),
    "rope factor negative": (lambda p: write_hf(p, rope_scaling={"type": "dynamic",
                                                                 "factor": -2.0}),
                             "config.json: rope_scaling.factor -2.0"),
    "rms eps negative": (lambda p: write_hf(p, rms_norm_eps=-1e-5),
                         "config.json: rms_norm_eps -1e-05"),
    "experts per token 9 of 4": (lambda p: write_hf(p, experts=True, num_experts_per_tok=9),
                                 "config.json: num_experts_per_tok 9 must be from 1 to the 4"),
    "experts per token 0": (lambda p: write_hf(p, experts=True, num_experts_per_tok=0),
                            "config.json: num_experts_per_tok 0"),
    "short LongRoPE factors": (lambda p: write_hf(p, model_type="phi3", rope_scaling=LONGROPE,
                                                  original_max_position_embeddings=64),
                               "config.json: rope_scaling.short_factor has 3 factors for 8"),
    "llama3 rope without low_freq_factor": (lambda p: write_hf(p, rope_scaling=LLAMA3),
                                            "config.json: rope_scaling.low_freq_factor is "
                                            "missing; rope_type llama3 needs it"),
    "sliding_window -5": (lambda p: write_hf(p, model_type="mistral", sliding_window=-5),
                          "config.json: sliding_window -5"),
    "config.json syntax error": (_syntax_error, "config.json: not valid JSON .*line 1 column"),
    "truncated safetensors": (_cut_safetensors,
                              "model.safetensors: tensor 'model.norm.weight' .*truncated"),
}  # fmt: skip
GGUF_CASES: dict[str, tuple[Callable[[Path], Path], str]] = {
    "block_count 10^6": (_gguf(block_count=BIG),
                         "m.gguf: llama.block_count 1000000: its tensors hold 2 layers"),
    "head_count 10^6": (_gguf(**{"attention.head_count": BIG}),
                        "m.gguf: llama.attention.head_count 1000000 does not divide"),
    "expert_count 10^6": (lambda p: write_gguf(p / "m.gguf", experts=True, expert_count=BIG),
                          "m.gguf: tensor 'blk.0.ffn_gate_inp.weight' is \\[4, 64\\], but "
                          "llama.expert_count 1000000"),
    "head_count 0": (_gguf(**{"attention.head_count": 0}), "m.gguf: llama.attention.head_count 0"),
    "block_count 0": (_gguf(block_count=0), "m.gguf: llama.block_count 0"),
    "freq_base NaN": (_gguf(**{"rope.freq_base": NAN}), "m.gguf: llama.rope.freq_base nan"),
    "freq_base 0": (_gguf(**{"rope.freq_base": 0.0}), "m.gguf: llama.rope.freq_base 0.0"),
    "rms eps negative": (_gguf(**{"attention.layer_norm_rms_epsilon": -1e-5}),
                         "m.gguf: llama.attention.layer_norm_rms_epsilon -1e-05"),
    "linear factor 0": (_gguf(**{"rope.scaling.type": "linear", "rope.scaling.factor": 0.0}),
                        "m.gguf: llama.rope.scaling.factor 0.0"),
    "experts used 9 of 4": (lambda p: write_gguf(p / "m.gguf", experts=True,
                                                 expert_used_count=9),
                            "m.gguf: llama.expert_used_count 9"),
    "experts used 0": (lambda p: write_gguf(p / "m.gguf", experts=True, expert_used_count=0),
                       "m.gguf: llama.expert_used_count 0"),
    "alignment 0": (lambda p: set_gguf_alignment(_gguf(**{"general.alignment": 32})(p), 0),
                    "m.gguf: general.alignment 0 is not a positive power of two"),
    "version 2^31": (lambda p: set_gguf_version(_gguf()(p), 2**31),
                     "m.gguf: GGUF version 2147483648 is not supported"),
    "a tensor past the end": (lambda p: cut(_gguf()(p), -100),
                              "m.gguf: tensor 'blk.1.ffn_down.weight' .*past the end of the "
                              "file"),
    "a header cut short": (lambda p: cut(_gguf()(p), 200), "m.gguf: the GGUF header is cut"),
}  # fmt: skip
HUGE = {"heads 10^6", "heads 10^6, head_dim given", "layers 10^6", "experts 10^6",
        "block_count 10^6", "head_count 10^6", "expert_count 10^6"}  # fmt: skip
CASES = {**HF_CASES, **{f"gguf {k}": v for k, v in GGUF_CASES.items()}}


@pytest.mark.parametrize("case", list(CASES))
def test_a_hostile_model_is_refused_naming_the_file_and_the_field(case, tmp_path):
    write, why = CASES[case]
    path = write(tmp_path)
    tracemalloc.start()
    try:
        with pytest.raises(ValueError) as err:
            check_model(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert re.search(f"^{re.escape(str(tmp_path))}/.*{why}", str(err.value)), str(err.value)
    if case.removeprefix("gguf ") in HUGE:  # refused by arithmetic, nothing built from it
        assert peak < 20 * 2**20, f"{peak / 2**20:.0f} MiB to refuse {case}"


def test_the_files_the_checks_refuse_are_otherwise_good(tmp_path):
    for experts in (False, True):
        arch = check_model(write_hf(tmp_path / f"hf{experts}", experts=experts))
        assert (arch.num_layers, arch.num_experts) == (2, 4 * experts)
        arch = check_model(write_gguf(tmp_path / f"{experts}.gguf", experts=experts))
        assert (arch.num_layers, arch.num_experts) == (2, 4 * experts)
    phi3 = {**LONGROPE, "short_factor": [1.0] * 8}
    with pytest.raises(ValueError, match="qkv_proj"):  # phi3's arch passes; its names do not
        check_model(write_hf(tmp_path / "phi3", model_type="phi3", rope_scaling=phi3,
                             original_max_position_embeddings=64))  # fmt: skip


def test_a_context_of_2_32_is_not_refused(tmp_path):
    """Real checkpoints declare contexts of millions: the context is the KV cache's to bound
    (tests/gpu_runner/test_long_context.py), not a reason to refuse the file."""
    assert check_model(_gguf(context_length=2**32 - 1)(tmp_path)).max_position == 2**32 - 1
    arch = check_model(write_hf(tmp_path / "hf", max_position_embeddings=10**9))
    assert arch.max_position == 10**9
