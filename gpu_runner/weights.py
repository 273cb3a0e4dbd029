"""Model weights under Hugging Face Llama/Qwen2 names, from safetensors or GGUF (never pickle)."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize
from safetensors import safe_open
from tqdm import tqdm

from gapless.core.common.config import ModelInfo
from gapless.core.common.model_files import GGUFFile, GGUFTensor, ModelArch, read_gguf

# GGUF tensor name (after "blk.{i}.") -> HF name (after "model.layers.{i}.")
_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GGUF_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def parameter_names(arch: ModelArch) -> list[str]:
    """Every parameter the model needs, in Hugging Face naming."""
    names = ["model.embed_tokens.weight"]
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        names += [p + f"self_attn.{x}_proj.weight" for x in "qkvo"]
        if arch.attention_bias:
            names += [p + f"self_attn.{x}_proj.bias" for x in "qkv"]
        names += [p + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")]
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
    names.append("model.norm.weight")
    if not arch.tie_word_embeddings:
        names.append("lm_head.weight")
    return names


def _progress(items: list, desc: str) -> Iterator:
    return iter(tqdm(items, desc=desc, unit="tensor", file=sys.stderr, leave=False,
                     disable=not sys.stderr.isatty()))  # fmt: skip


def _safetensors_files(path: Path) -> dict[str, Path]:
    """Parameter name -> the file holding it."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: path / file for name, file in weight_map.items()}
    owner: dict[str, Path] = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            owner.update(dict.fromkeys(f.keys(), file))
    return owner


def _load_safetensors(path: Path, names: list[str], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    owner = _safetensors_files(path)
    missing = [n for n in names if n not in owner]
    if missing:
        raise ValueError(f"{path}: safetensors lack {len(missing)} parameters, e.g. {missing[:3]}")
    by_file: dict[Path, list[str]] = {}
    for name in names:
        by_file.setdefault(owner[name], []).append(name)
    out: dict[str, torch.Tensor] = {}
    for file, file_names in _progress(list(by_file.items()), "loading weights"):
        with safe_open(str(file), framework="pt") as f:
            for name in file_names:
                out[name] = f.get_tensor(name).to(dtype)
    return out


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GGUF_NAMES:
        return _GGUF_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)  # ["blk", "{i}", rest]
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _GGUF_LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_GGUF_LAYER_NAMES[parts[2]]}"
    return None


def _dequantize(raw: np.memmap, t: GGUFTensor) -> np.ndarray:
    """float32 array of shape t.shape ([out, in] order) from the tensor's bytes."""
    qtype = GGMLQuantizationType(t.qtype)
    block, block_bytes = GGML_QUANT_SIZES[qtype]
    numel = int(np.prod(t.shape))
    nbytes = numel // block * block_bytes
    data = raw[t.offset : t.offset + nbytes]
    if qtype not in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        data = data.reshape(-1, t.shape[-1] // block * block_bytes)  # one row per output
    arr = np.require(dequantize(data, qtype), np.float32, ["C", "W"])  # F32 views are read-only
    return arr.reshape(t.shape)


def _unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    # llama.cpp interleaves each head's rotary halves; HF keeps them as two halves
    out, inp = w.shape
    return w.reshape(heads, out // heads // 2, 2, inp).transpose(1, 2).reshape(out, inp)


def _load_gguf(gguf: GGUFFile, arch: ModelArch, names: list[str], dtype: torch.dtype):
    wanted = set(names)
    pairs = []
    for gguf_name, t in gguf.tensors.items():
        name = _hf_name(gguf_name)
        if name is None:
            raise ValueError(f"{gguf.path}: tensor {gguf_name!r} has no known meaning")
        if name in wanted:
            pairs.append((name, t))
    missing = wanted - {name for name, _ in pairs}
    if missing:
        raise ValueError(f"{gguf.path}: lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}")
    raw = np.memmap(gguf.path, dtype=np.uint8, mode="r")
    out: dict[str, torch.Tensor] = {}
    for name, t in _progress(pairs, "dequantizing"):
        w = torch.from_numpy(_dequantize(raw, t))
        # llama.cpp permutes Q/K rows only for llama's interleaved rope; qwen2 files are not
        if arch.architecture == "llama" and name.endswith("q_proj.weight"):
            w = _unpermute(w, arch.num_heads)
        elif arch.architecture == "llama" and name.endswith("k_proj.weight"):
            w = _unpermute(w, arch.num_kv_heads)
        out[name] = w.to(dtype).contiguous()
    del raw
    return out


def load_weights(info: ModelInfo, arch: ModelArch, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """All parameters (see parameter_names) as CPU tensors of dtype, keyed by HF names."""
    path = Path(info.path)
    names = parameter_names(arch)
    if path.is_dir():
        return _load_safetensors(path, names, dtype)
    return _load_gguf(read_gguf(path), arch, names, dtype)
