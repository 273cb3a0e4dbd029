"""LoRA adapters in peft's format: a directory with adapter_config.json and
adapter_model.safetensors (never .bin or .pt), read and held to the base's shapes; llama.cpp's
GGUF LoRA files are read by gguf_adapter.py into the same Adapter.

A target projection W [out, in] gains y += scale * B (A x), A [r, in], B [out, r]; scale is
alpha / r, or alpha / sqrt(r) with use_rslora. r and alpha are the config's, or the values of
its rank_pattern / alpha_pattern whose key matches the module's name as peft matches them (the
key is a suffix of the name at a dot). Anything peft can save that the layers do not compute
(DoRA, modules_to_save, biases, embeddings or the output layer as targets, a layer the family
does not have) is refused with an AdapterError naming it, before any weight is kept.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from gapless.common import families
from gapless.common.families.base import ModelArch

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
MAX_LORA_RANK = 16  # --max-lora-rank's default, as vLLM's
_PREFIX = "base_model.model."
_KEY = re.compile(r"(?P<module>.+)\.lora_(?P<which>[AB])(?:\.[^.]+)?\.weight")
_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_JOINED = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")  # a fused family's (Phi-3)
_NEVER = ("embed_tokens", "lm_head", "wte", "word_embeddings", "embed_out", "output")
# peft options whose every value but these changes what the layers compute
_ONLY = {"peft_type": ("LORA",), "bias": ("none",), "use_dora": (False,), "lora_bias": (False,),
         "fan_in_fan_out": (False,), "modules_to_save": (None, []),
         "layer_replication": (None, []), "target_parameters": (None, []),
         "trainable_token_indices": (None, [], {}), "alora_invocation_tokens": (None, []),
         "use_qalora": (False,), "use_bdlora": (None, False)}  # fmt: skip


class AdapterError(ValueError):
    """An adapter that cannot be served; the message names the file, option or module."""


@dataclass
class LoraWeights:
    """One target projection's pair, float32 on the host."""

    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [out, r]
    scale: float


@dataclass
class Adapter:
    name: str
    path: str
    rank: int  # the largest of its modules' ranks
    # module name as the base model's ("model.layers.3.self_attn.q_proj") -> its pair
    modules: dict[str, LoraWeights]


def pattern_value(patterns: dict, module: str, default):
    """The value of the first pattern key that matches module as a suffix at a dot (peft's
    rule), else default."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def read_config(path: Path) -> dict:
    """adapter_config.json of an adapter directory, its unsupported options refused."""
    if not path.is_dir():
        raise AdapterError(f"{path}: not a directory with {CONFIG} and {WEIGHTS}, nor a "
                           "GGUF LoRA file")  # fmt: skip
    if not (path / WEIGHTS).is_file():
        other = [p.name for p in path.glob("adapter_model.*")]
        found = f" (found {', '.join(other)}: only safetensors are read)" if other else ""
        raise AdapterError(f"{path}: no {WEIGHTS}{found}")
    try:
        config = json.loads((path / CONFIG).read_text())
    except (OSError, ValueError) as e:
        raise AdapterError(f"{path / CONFIG}: {e}") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{path / CONFIG}: not a JSON object")
    for option, allowed in _ONLY.items():
        value = config.get(option, allowed[0])
        if value not in allowed:
            raise AdapterError(f"{path.name}: {option}={value!r} is not supported")
    targets = config.get("target_modules") or []
    names = [targets] if isinstance(targets, str) else list(targets)
    for name in names:
        if name.rsplit(".", 1)[-1] in _NEVER:
            raise AdapterError(f"{path.name}: target {name!r}: adapters on the embeddings or "
                               "the output layer are not supported")  # fmt: skip
    for key in ("r", "lora_alpha"):
        if not isinstance(config.get(key, 8), int | float):
            raise AdapterError(f"{path.name}: {key} must be a number")
    return config


def part_shape(arch: ModelArch, module: str) -> tuple[int, int] | None:
    """(out, in) of a projection the family has, by its base-model name; None if it has not."""
    fused = families.family(arch.architecture).fused
    m = re.fullmatch(r"model\.layers\.(\d+)\.(self_attn|mlp|mlp\.shared_expert)\.(\w+)", module)
    if m is None or int(m.group(1)) >= arch.num_layers:
        return None
    layer, where, leaf = int(m.group(1)), m.group(2), m.group(3)
    if leaf not in (_JOINED if fused else _LINEAR):
        return None
    h = arch.hidden_size
    if where == "self_attn":
        q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
        shapes = {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h),
                  "qkv_proj": (q + 2 * kv, h), "o_proj": (h, q)}  # fmt: skip
        return shapes.get(leaf)
    if where == "mlp" and arch.is_moe(layer):
        return None  # the routed experts and the router
    i = arch.shared_expert_intermediate_size if where != "mlp" else arch.intermediate_size
    if not i:
        return None
    shapes = {
        "gate_proj": (i, h),
        "up_proj": (i, h),
        "gate_up_proj": (2 * i, h),
        "down_proj": (h, i),
    }
    return shapes.get(leaf)


def _module_of(key: str) -> tuple[str, str]:
    m = _KEY.fullmatch(key.removeprefix(_PREFIX))
    if m is None:
        raise AdapterError(f"tensor {key!r} is not a LoRA A or B weight")
    return m.group("module"), m.group("which")


def load_adapter(
    name: str, path: str | Path, arch: ModelArch, max_rank: int = MAX_LORA_RANK
) -> Adapter:
    """The adapter at path (a peft directory, or a llama.cpp GGUF LoRA file) for the base arch;
    AdapterError if it cannot be served as it is."""
    from gapless.common.gguf_file import is_gguf
    from gapless.gpu_runner.lora.gguf_adapter import load_gguf_adapter

    path = Path(path)
    if path.is_file() and is_gguf(path):
        return load_gguf_adapter(name, path, arch, max_rank)
    config = read_config(path)
    r0, alpha0 = config.get("r", 8), config.get("lora_alpha", 8)
    ranks, alphas = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}
    rslora = bool(config.get("use_rslora", False))
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    with safe_open(str(path / WEIGHTS), framework="pt") as f:
        keys = list(f.keys())
        for key in keys:
            module, which = _module_of(key)
            leaf = module.rsplit(".", 1)[-1]
            if leaf in _NEVER or "lora_embedding" in key:
                raise AdapterError(f"{name}: {module}: adapters on the embeddings or the output "
                                   "layer are not supported")  # fmt: skip
            if ".experts." in module:
                raise AdapterError(f"{name}: {module}: adapters on routed experts are not "
                                   "supported (attention and shared experts are)")  # fmt: skip
            if part_shape(arch, module) is None:
                raise AdapterError(f"{name}: target {module} is not a projection of this "
                                   f"{arch.architecture} model")  # fmt: skip
            pairs.setdefault(module, {})[which] = f.get_slice(key)
    if not pairs:
        raise AdapterError(f"{name}: {WEIGHTS} holds no LoRA weights")
    modules = {}
    for module, pair in pairs.items():
        modules[module] = _pair(name, module, pair, arch, max_rank,
                                pattern_value(ranks, module, r0),
                                pattern_value(alphas, module, alpha0), rslora)  # fmt: skip
    return Adapter(name, str(path), max(len(w.a) for w in modules.values()), modules)


def _pair(name, module, pair, arch, max_rank, r, alpha, rslora) -> LoraWeights:
    if set(pair) != {"A", "B"}:
        raise AdapterError(f"{name}: {module}: lora_A and lora_B must both be present")
    out, inp = part_shape(arch, module)
    a_shape, b_shape = tuple(pair["A"].get_shape()), tuple(pair["B"].get_shape())
    if a_shape != (r, inp) or b_shape != (out, r):
        raise AdapterError(f"{name}: {module}: lora_A {list(a_shape)} and lora_B "
                           f"{list(b_shape)} do not fit r={r} and the layer's [{out}, {inp}]")  # fmt: skip
    if r > max_rank:
        raise AdapterError(f"{name}: {module}: rank {r} is over --max-lora-rank {max_rank}")
    scale = alpha / math.sqrt(r) if rslora else alpha / r
    return LoraWeights(pair["A"][:].float(), pair["B"][:].float(), float(scale))
