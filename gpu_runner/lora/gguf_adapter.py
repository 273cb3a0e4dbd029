"""LoRA adapters in llama.cpp's GGUF format (what its convert_lora_to_gguf.py writes from
peft's files): `general.type` = adapter, `adapter.type` = lora, `adapter.lora.alpha`, and per
target projection `blk.N.<name>.weight.lora_a` [r, in] and `.lora_b` [out, r] under the base's
GGUF names, which map to the base's projections as its own GGUF weights do
(common/parameters.py, families' gguf_names). The scale is alpha / r, r being lora_a's rows
(llama.cpp's rule: no alpha, or 0, scales by 1). Where the family's converter interleaved q and
k rows (llama's rotary layout), it did so to lora_b's rows too; they are put back here. The
result is the Adapter peft's files give (adapter.py), held to the same rules.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.constants import GGML_QUANT_SIZES

from gapless.common import families
from gapless.common.families.base import ModelArch
from gapless.common.gguf_file import GGUFTensor, read_gguf
from gapless.common.parameters import hf_name
from gapless.gpu_runner.lora.adapter import Adapter, AdapterError, LoraWeights, part_shape
from gapless.gpu_runner.model.weights import dequantized, unpermuted

_SUFFIX = {".lora_a": "A", ".lora_b": "B"}


def load_gguf_adapter(name: str, path: Path, arch: ModelArch, max_rank: int) -> Adapter:
    """The GGUF LoRA adapter at path for the base arch; AdapterError naming the file and the
    cause if it is not one, or does not fit the base."""
    try:
        gguf = read_gguf(path)
    except (OSError, ValueError) as e:
        raise AdapterError(f"{name}: {e}") from None
    where = f"{name}: {path.name}"
    _check_header(where, gguf.metadata, arch)
    pairs = _pairs(where, gguf.tensors, arch)
    alpha = gguf.metadata.get("adapter.lora.alpha", 0)
    if not isinstance(alpha, int | float):
        raise AdapterError(f"{where}: adapter.lora.alpha must be a number")
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    modules = {m: _weights(where, m, pair, raw, arch, max_rank, alpha) for m, pair in pairs.items()}
    del raw
    return Adapter(name, str(path), max(len(w.a) for w in modules.values()), modules)


def _check_header(where: str, meta: dict, arch: ModelArch) -> None:
    kind, adapter = meta.get("general.type"), meta.get("adapter.type")
    if kind != "adapter" or adapter != "lora":
        what = f"general.type {kind!r}" if kind != "adapter" else f"adapter.type {adapter!r}"
        raise AdapterError(f"{where}: not a LoRA adapter ({what}; a llama.cpp LoRA GGUF has "
                           "general.type 'adapter' and adapter.type 'lora')")  # fmt: skip
    if any(k.startswith("adapter.alora.") for k in meta):
        raise AdapterError(f"{where}: activated LoRA (adapter.alora.*) is not supported")
    fam = families.family(arch.architecture)
    if not fam.gguf_arch:
        raise AdapterError(f"{where}: GGUF adapters need a family gapless reads from GGUF; "
                           f"{arch.architecture} is not one")  # fmt: skip
    got = meta.get("general.architecture")
    if got != fam.gguf_arch:
        raise AdapterError(f"{where}: the adapter is for architecture {got!r}, the model is "
                           f"{fam.gguf_arch!r}")  # fmt: skip


def _pairs(where: str, tensors: dict[str, GGUFTensor], arch: ModelArch) -> dict[str, dict]:
    """module name (the base's) -> {"A": tensor, "B": tensor} of every lora_a / lora_b."""
    names = families.family(arch.architecture).gguf_names
    pairs: dict[str, dict[str, GGUFTensor]] = {}
    for key, t in tensors.items():
        stem, suffix = key[: -len(".lora_a")], key[-len(".lora_a") :]
        if suffix not in _SUFFIX:
            raise AdapterError(f"{where}: tensor {key!r} is not a LoRA lora_a or lora_b weight")
        ours = hf_name(stem, names)
        if stem.split(".", 1)[0] in ("token_embd", "output"):
            raise AdapterError(f"{where}: {stem}: adapters on the embeddings or the output "
                               "layer are not supported")  # fmt: skip
        module = ours.removesuffix(".weight") if ours and ours.endswith(".weight") else None
        if module and ".experts." in module:
            raise AdapterError(f"{where}: {stem}: adapters on routed experts are not "
                               "supported (attention and shared experts are)")  # fmt: skip
        if module is None or part_shape(arch, module) is None:
            raise AdapterError(f"{where}: tensor {key!r} is not on a projection of this "
                               f"{arch.architecture} model")  # fmt: skip
        pairs.setdefault(module, {})[_SUFFIX[suffix]] = t
    if not pairs:
        raise AdapterError(f"{where}: holds no LoRA tensors")
    return pairs


def _weights(where, module, pair, raw, arch, max_rank, alpha) -> LoraWeights:
    if set(pair) != {"A", "B"}:
        raise AdapterError(f"{where}: {module}: lora_a and lora_b must both be present")
    out, inp = part_shape(arch, module)
    a_shape, b_shape = pair["A"].shape, pair["B"].shape
    r = a_shape[0] if len(a_shape) == 2 else 0
    if a_shape != (r, inp) or b_shape != (out, r) or r == 0:
        raise AdapterError(f"{where}: {module}: lora_a {list(a_shape)} and lora_b "
                           f"{list(b_shape)} do not fit the layer's [{out}, {inp}]")  # fmt: skip
    if r > max_rank:
        raise AdapterError(f"{where}: {module}: rank {r} is over --max-lora-rank {max_rank}")
    a, b = (_tensor(where, raw, pair[x]) for x in ("A", "B"))
    b = unpermuted(module + ".weight", b, arch)  # lora_b's rows are the projection's rows
    return LoraWeights(a, b, float(alpha / r) if alpha else 1.0)


def _tensor(where: str, raw: np.memmap, t: GGUFTensor) -> torch.Tensor:
    try:
        qtype = GGMLQuantizationType(t.qtype)
        block, block_bytes = GGML_QUANT_SIZES[qtype]
    except (ValueError, KeyError):
        raise AdapterError(f"{where}: {t.name}: GGML type {t.qtype} is unknown") from None
    numel = int(np.prod(t.shape))
    if t.shape[-1] % block or t.offset + numel // block * block_bytes > len(raw):
        raise AdapterError(f"{where}: {t.name}: its data does not fit the file")
    return torch.from_numpy(dequantized(raw, t)).float().contiguous()
