"""The decoder families gapless serves: each a small declaration (its module here) over the
shared decoder (gpu_runner/model/). A checkpoint of another family is refused, naming it and
this list. Adding a family: a module with its Family, listed in FAMILIES, and its test against
transformers (tests/gpu_runner/test_families.py)."""

from __future__ import annotations

from gapless.common.families.base import (
    Family,
    GGUFMeta,
    ModelArch,
    gguf_experts,
    gguf_shapes,
    shapes,
)
from gapless.common.families.gemma2 import GEMMA2
from gapless.common.families.gemma3 import GEMMA3
from gapless.common.families.llama import LLAMA
from gapless.common.families.mistral import MISTRAL
from gapless.common.families.mixtral import MIXTRAL
from gapless.common.families.phi3 import PHI3
from gapless.common.families.qwen2 import QWEN2
from gapless.common.families.qwen2_moe import QWEN2_MOE
from gapless.common.families.qwen3 import QWEN3
from gapless.common.families.qwen3_moe import QWEN3_MOE

__all__ = ["FAMILIES", "Family", "GGUFMeta", "ModelArch", "family", "for_gguf",
           "for_model_type", "arch_from_config", "arch_from_gguf", "read_config"]  # fmt: skip

FAMILIES: tuple[Family, ...] = (LLAMA, MISTRAL, QWEN2, QWEN3, GEMMA2, GEMMA3, PHI3, MIXTRAL,
                                QWEN2_MOE, QWEN3_MOE)  # fmt: skip
_BY_NAME = {f.name: f for f in FAMILIES}
_BY_MODEL_TYPE = {t: f for f in FAMILIES for t in f.model_types}


def family(name: str) -> Family:
    """A family by its name (ModelArch.architecture, ModelInfo.architecture)."""
    return _BY_NAME[name]


def for_model_type(model_type: str, source: str) -> Family:
    if model_type not in _BY_MODEL_TYPE:
        raise ValueError(
            f"{source}: architecture {model_type!r} is not supported "
            f"(supported: {sorted(_BY_MODEL_TYPE)})"
        )
    return _BY_MODEL_TYPE[model_type]


def for_gguf(arch: str, has_experts: bool, source: str) -> Family:
    """The family of a GGUF's general.architecture (llama with experts is Mixtral)."""
    found = [f for f in FAMILIES if f.gguf_arch == arch]
    match = [f for f in found if f.moe == has_experts] or found
    if not match:
        names = sorted({f.gguf_arch for f in FAMILIES if f.gguf_arch})
        raise ValueError(f"{source}: architecture {arch!r} is not supported (supported: {names})")
    return match[0]


def read_config(raw: dict, source: str) -> tuple[Family, dict]:
    """The family of a config.json and the decoder's config: its own (a multimodal config's
    text part), the family's defaults filled in."""
    fam = for_model_type(str(raw.get("model_type")), source)
    config = raw.get(fam.text_config) if fam.text_config else None
    return fam, {**fam.defaults, **(config if isinstance(config, dict) else raw)}


def arch_from_config(raw: dict, source: str) -> ModelArch:
    fam, config = read_config(raw, source)
    return ModelArch(architecture=fam.name, **{**shapes(config), **fam.options(config)})


def arch_from_gguf(meta: GGUFMeta, vocab_size: int) -> ModelArch:
    fam = for_gguf(meta.arch, bool(meta.metadata.get(f"{meta.arch}.expert_count")), meta.path)
    fields = {**gguf_shapes(meta, vocab_size), **gguf_experts(meta), **fam.gguf_options(meta)}
    renormalize = meta.metadata.get(f"{meta.arch}.expert_weights_norm")
    if renormalize is not None:  # newer llama.cpp files say it; older ones by architecture
        fields["norm_topk_prob"] = bool(renormalize)
    return ModelArch(architecture=fam.name, **fields)
