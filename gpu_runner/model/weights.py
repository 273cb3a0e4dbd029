"""Model weights under Hugging Face's names, from safetensors or GGUF (never pickle).

The names are Llama's (model.layers.N.self_attn.q_proj.weight, ...) for every family: a
family's own checkpoint names are renamed (families' `renames`), GGUF's llama.cpp names
mapped (common/parameters.py's table and families' `gguf_names`). A GGUF file's experts come
stacked (mlp.experts.gate_proj [E, I, H]); fuse_weights (gpu_runner/model) joins the rest.
"""

from __future__ import annotations

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
from gapless.common.model_check import Held, check_weights
from gapless.common.model_files import GGUFFile, GGUFTensor, ModelArch, read_gguf
from gapless.common.parameters import hf_name, parameter_names

__all__ = ["dequantized", "hf_name", "load_weights", "parameter_names", "unpermuted"]


def _progress(items: list, desc: str) -> Iterator:
    return iter(tqdm(items, desc=desc, unit="tensor", file=sys.stderr, leave=False,
                     disable=not sys.stderr.isatty()))  # fmt: skip


def _load_safetensors(held: dict[str, Held], names: list[str], dtype: torch.dtype) -> dict:
    by_file: dict[str, list[str]] = {}
    for name in names:
        by_file.setdefault(held[name].file, []).append(name)
    out: dict[str, torch.Tensor] = {}
    for file, file_names in _progress(list(by_file.items()), "loading weights"):
        with safe_open(file, framework="pt") as f:
            for name in file_names:
                out[name] = f.get_tensor(held[name].name).to(dtype)
    return out


def dequantized(raw: np.memmap, t: GGUFTensor) -> np.ndarray:
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


def _load_gguf(gguf: GGUFFile, held: dict[str, Held], names: list[str], arch: ModelArch,
               dtype: torch.dtype) -> dict[str, torch.Tensor]:  # fmt: skip
    raw = np.memmap(gguf.path, dtype=np.uint8, mode="r")
    out: dict[str, torch.Tensor] = {}
    for name in _progress(names, "dequantizing"):
        t = gguf.tensors[held[name].name]
        w = unpermuted(name, torch.from_numpy(dequantized(raw, t)), arch)
        if name.endswith("shared_expert_gate.weight"):
            w = w.reshape(1, -1)  # why: llama.cpp keeps this [1, H] layer as a vector
        out[name] = w.to(dtype).contiguous()
    del raw
    return out


def load_weights(info: ModelInfo, arch: ModelArch, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """All parameters (see parameter_names) as CPU tensors of dtype, keyed by HF names; the
    files' headers are held to arch first (common/model_check.py), so a file that does not
    fit it is refused, naming the tensor, before any data is read."""
    path = Path(info.path)
    fam = families.family(arch.architecture)
    if path.is_dir():
        held = check_weights(path, arch)
        return _load_safetensors(held, parameter_names(arch, fam.fused), dtype)
    gguf = read_gguf(path)
    held = check_weights(path, arch, gguf)
    joined = "blk.0.attn_qkv.weight" in gguf.tensors
    return _load_gguf(gguf, held, parameter_names(arch, fam.fused, joined, True), arch, dtype)
