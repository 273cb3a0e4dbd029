"""Tiny Llama-shaped models written here in milliseconds (no transformers), for the checks of
model files (common/model_check.py): a Hugging Face directory and a GGUF file, dense or with
experts, any config value or metadata key replaced, and the ways a file gets cut or corrupted.
The weights are random; only their names, shapes and bytes matter here."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

SHAPE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=96, max_position_embeddings=512,
             rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True)  # fmt: skip
EXPERTS = dict(num_local_experts=4, num_experts_per_tok=2)
TOKENIZER = {"version": "1.0", "model": {"type": "WordLevel", "vocab": {"a": 0}, "unk_token": "a"}}
H, FF, V, Q, KV, E = 64, 96, 96, 64, 32, 4  # hidden, MLP, vocab, q rows, k/v rows, experts


def _rand(*shape: int) -> np.ndarray:
    return np.random.default_rng(0).standard_normal(shape, dtype=np.float32)


def _hf_tensors(experts: bool) -> dict[str, np.ndarray]:
    out = {"model.embed_tokens.weight": _rand(V, H), "model.norm.weight": _rand(H)}
    for i in range(2):
        p = f"model.layers.{i}."
        for name, shape in (("q_proj", (Q, H)), ("k_proj", (KV, H)), ("v_proj", (KV, H)),
                            ("o_proj", (H, Q))):  # fmt: skip
            out[p + f"self_attn.{name}.weight"] = _rand(*shape)
        out[p + "input_layernorm.weight"] = out[p + "post_attention_layernorm.weight"] = _rand(H)
        if not experts:
            out[p + "mlp.gate_proj.weight"] = out[p + "mlp.up_proj.weight"] = _rand(FF, H)
            out[p + "mlp.down_proj.weight"] = _rand(H, FF)
            continue
        out[p + "block_sparse_moe.gate.weight"] = _rand(E, H)
        for j in range(E):
            e = p + f"block_sparse_moe.experts.{j}."
            out[e + "w1.weight"] = out[e + "w3.weight"] = _rand(FF, H)
            out[e + "w2.weight"] = _rand(H, FF)
    return out


def write_hf(path: Path, experts: bool = False, **config) -> Path:
    """A Llama directory (Mixtral with experts) at path, its config.json's keys overridden by
    config (a value None removes the key)."""
    from safetensors.numpy import save_file

    path.mkdir(parents=True, exist_ok=True)
    base = {
        "model_type": "mixtral" if experts else "llama",
        **SHAPE,
        **(EXPERTS if experts else {}),
    }
    merged = {k: v for k, v in {**base, **config}.items() if v is not None}
    (path / "config.json").write_text(json.dumps(merged))
    (path / "tokenizer.json").write_text(json.dumps(TOKENIZER))
    save_file(_hf_tensors(experts), str(path / "model.safetensors"))
    return path


def _gguf_tensors(experts: bool) -> dict[str, np.ndarray]:
    out = {"token_embd.weight": _rand(V, H), "output_norm.weight": _rand(H)}
    for i in range(2):
        p = f"blk.{i}."
        for name, shape in (("attn_q", (Q, H)), ("attn_k", (KV, H)), ("attn_v", (KV, H)),
                            ("attn_output", (H, Q))):  # fmt: skip
            out[p + name + ".weight"] = _rand(*shape)
        out[p + "attn_norm.weight"] = out[p + "ffn_norm.weight"] = _rand(H)
        if experts:
            out[p + "ffn_gate_inp.weight"] = _rand(E, H)
            out[p + "ffn_gate_exps.weight"] = out[p + "ffn_up_exps.weight"] = _rand(E, FF, H)
            out[p + "ffn_down_exps.weight"] = _rand(E, H, FF)
        else:
            out[p + "ffn_gate.weight"] = out[p + "ffn_up.weight"] = _rand(FF, H)
            out[p + "ffn_down.weight"] = _rand(H, FF)
    return out


def write_gguf(path: Path, experts: bool = False, **metadata) -> Path:
    """A Llama GGUF file (Mixtral's layout with experts); metadata: keys after "llama." (a
    "general." key as it is) and their values: uint32 for ints (uint64 past it), float32 for
    floats, strings."""
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    keys = {"block_count": 2, "context_length": 512, "embedding_length": H,
            "feed_forward_length": FF, "attention.head_count": 4, "attention.head_count_kv": 2,
            "rope.freq_base": 10000.0, "attention.layer_norm_rms_epsilon": 1e-5}  # fmt: skip
    if experts:
        keys.update({"expert_count": E, "expert_used_count": 2})
    keys.update(metadata)
    for key, value in keys.items():
        name = key if key.startswith("general.") else f"llama.{key}"
        if isinstance(value, str):
            w.add_string(name, value)
        elif isinstance(value, float):
            w.add_float32(name, value)
        elif value > 2**32 - 1:
            w.add_uint64(name, value)
        else:
            w.add_uint32(name, value)
    w.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(V)])
    for name, array in _gguf_tensors(experts).items():
        w.add_tensor(name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def set_gguf_version(path: Path, version: int) -> Path:
    data = bytearray(path.read_bytes())
    data[4:8] = struct.pack("<I", version)
    path.write_bytes(bytes(data))
    return path


def set_gguf_alignment(path: Path, alignment: int) -> Path:
    """general.alignment's uint32 value, on a file written with that key (32)."""
    data = bytearray(path.read_bytes())
    at = data.index(b"general.alignment") + len("general.alignment") + 4  # past the type
    assert struct.unpack_from("<I", data, at) == (32,)
    data[at : at + 4] = struct.pack("<I", alignment)
    path.write_bytes(bytes(data))
    return path


def cut(path: Path, keep: int) -> Path:
    """The file's first `keep` bytes only (negative: all but the last -keep)."""
    data = path.read_bytes()
    path.write_bytes(data[:keep])
    return path
