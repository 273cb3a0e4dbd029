"""Model weights under Hugging Face's names, from safetensors or GGUF (never pickle).

The names are Llama's (model.layers.N.self_attn.q_proj.weight, ...) for every family: a
family's own checkpoint names are renamed (families' `renames`), GGUF's llama.cpp names
mapped (the shared table below and families' `gguf_names`). A GGUF file's experts come
stacked (mlp.experts.gate_proj [E, I, H]); fuse_weights (gpu_runner/model) joins the rest.
"""

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

from gapless.common import families
from gapless.common.config import ModelInfo
from gapless.common.model_files import GGUFFile, GGUFTensor, ModelArch, read_gguf

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
    "attn_output.bias": "self_attn.o_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_exps.weight": "mlp.experts.gate_proj",  # [E, I, H]
    "ffn_up_exps.weight": "mlp.experts.up_proj",
    "ffn_down_exps.weight": "mlp.experts.down_proj",  # [E, H, I]
}
_GGUF_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# GGUF tensors the loader reads elsewhere or not at all (RoPE factors: families read them)
_GGUF_SKIPPED = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


def parameter_names(
    arch: ModelArch, fused: bool = False, joined_qkv: bool | None = None, stacked: bool = False
) -> list[str]:
    """Every parameter the model needs, in Hugging Face naming. fused: q/k/v and gate/up come
    joined (qkv_proj, gate_up_proj; joined_qkv overrides for q/k/v); stacked: each layer's
    experts come as one tensor per projection."""
    joined_qkv = fused if joined_qkv is None else joined_qkv
    names = ["model.embed_tokens.weight"]
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        attn = ["qkv"] if joined_qkv else ["q", "k", "v"]
        names += [p + f"self_attn.{x}_proj.weight" for x in [*attn, "o"]]
        if arch.attention_bias:
            names += [p + f"self_attn.{x}_proj.bias" for x in attn]
        if arch.o_bias:
            names.append(p + "self_attn.o_proj.bias")
        if arch.qk_norm:
            names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
        names += _mlp_names(arch, i, p + "mlp.", fused, stacked)
        norms = ["input_layernorm", "post_attention_layernorm"]
        if arch.sandwich_norm:
            norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
        names += [p + norm + ".weight" for norm in norms]
    names.append("model.norm.weight")
    if not arch.tie_word_embeddings:
        names.append("lm_head.weight")
    return names


def _mlp_names(arch: ModelArch, layer: int, p: str, fused: bool, stacked: bool) -> list[str]:
    dense = ["gate_up"] if fused else ["gate", "up"]
    if not arch.is_moe(layer):
        return [p + f"{x}_proj.weight" for x in [*dense, "down"]]
    names = [p + "gate.weight"]
    if stacked:
        names += [p + f"experts.{x}_proj" for x in ("gate", "up", "down")]
    else:
        names += [
            p + f"experts.{j}.{x}_proj.weight"
            for j in range(arch.num_experts)
            for x in ("gate", "up", "down")
        ]
    if arch.shared_expert_intermediate_size:
        names += [p + f"shared_expert.{x}_proj.weight" for x in [*dense, "down"]]
        names.append(p + "shared_expert_gate.weight")
    return names


def _progress(items: list, desc: str) -> Iterator:
    return iter(tqdm(items, desc=desc, unit="tensor", file=sys.stderr, leave=False,
                     disable=not sys.stderr.isatty()))  # fmt: skip


def _renamed(name: str, renames: tuple[tuple[str, str], ...]) -> str:
    for old, new in renames:
        name = name.replace(old, new)
    return name


def _safetensors_files(path: Path, renames: tuple[tuple[str, str], ...]) -> dict:
    """Parameter name (ours) -> (the file holding it, its name there)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        owners = {name: path / file for name, file in weight_map.items()}
    else:
        owners = {}
        for file in sorted(path.glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as f:
                owners.update(dict.fromkeys(f.keys(), file))
    return {_renamed(name, renames): (file, name) for name, file in owners.items()}


def _load_safetensors(path: Path, names: list[str], dtype: torch.dtype, renames) -> dict:
    owner = _safetensors_files(path, renames)
    missing = [n for n in names if n not in owner]
    if missing:
        raise ValueError(f"{path}: safetensors lack {len(missing)} parameters, e.g. {missing[:3]}")
    by_file: dict[Path, list[str]] = {}
    for name in names:
        by_file.setdefault(owner[name][0], []).append(name)
    out: dict[str, torch.Tensor] = {}
    for file, file_names in _progress(list(by_file.items()), "loading weights"):
        with safe_open(str(file), framework="pt") as f:
            for name in file_names:
                out[name] = f.get_tensor(owner[name][1]).to(dtype)
    return out


def hf_name(gguf_name: str, arch_names: dict[str, str] | None = None) -> str | None:
    """Our name of a GGUF tensor; arch_names: the family's own (families' gguf_names)."""
    if gguf_name in _GGUF_NAMES:
        return _GGUF_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)  # ["blk", "{i}", rest]
    if len(parts) != 3 or parts[0] != "blk":
        return None
    table = {**_GGUF_LAYER_NAMES, **(arch_names or {})}
    return f"model.layers.{parts[1]}.{table[parts[2]]}" if parts[2] in table else None


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


def unpermuted(name: str, w: torch.Tensor, arch: ModelArch) -> torch.Tensor:
    """A GGUF tensor in Hugging Face's row order: q and k rows un-interleaved where the
    family's llama.cpp converter interleaved them (llama's rotary layout), else as is."""
    if not families.family(arch.architecture).gguf_permuted_qk:
        return w
    if name.endswith("q_proj.weight"):
        return _unpermute(w, arch.num_heads)
    if name.endswith("k_proj.weight"):
        return _unpermute(w, arch.num_kv_heads)
    return w


def _gguf_pairs(gguf: GGUFFile, arch: ModelArch) -> list[tuple[str, GGUFTensor]]:
    arch_names = families.family(arch.architecture).gguf_names
    pairs = []
    for gguf_name, t in gguf.tensors.items():
        name = hf_name(gguf_name, arch_names)
        if name is None and gguf_name not in _GGUF_SKIPPED:
            raise ValueError(f"{gguf.path}: tensor {gguf_name!r} has no known meaning")
        if name is not None:
            pairs.append((name, t))
    return pairs


def _load_gguf(gguf: GGUFFile, arch: ModelArch, dtype: torch.dtype):
    pairs = _gguf_pairs(gguf, arch)
    fam = families.family(arch.architecture)
    wanted = set(
        parameter_names(arch, fam.fused, "blk.0.attn_qkv.weight" in gguf.tensors, stacked=True)
    )
    missing = wanted - {name for name, _ in pairs}
    if missing:
        raise ValueError(f"{gguf.path}: lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}")
    raw = np.memmap(gguf.path, dtype=np.uint8, mode="r")
    out: dict[str, torch.Tensor] = {}
    for name, t in _progress([p for p in pairs if p[0] in wanted], "dequantizing"):
        w = unpermuted(name, torch.from_numpy(_dequantize(raw, t)), arch)
        if name.endswith("shared_expert_gate.weight"):
            w = w.reshape(1, -1)  # why: llama.cpp keeps this [1, H] layer as a vector
        out[name] = w.to(dtype).contiguous()
    del raw
    return out


def load_weights(info: ModelInfo, arch: ModelArch, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """All parameters (see parameter_names) as CPU tensors of dtype, keyed by HF names."""
    path = Path(info.path)
    fam = families.family(arch.architecture)
    if path.is_dir():
        return _load_safetensors(path, parameter_names(arch, fam.fused), dtype, fam.renames)
    return _load_gguf(read_gguf(path), arch, dtype)
