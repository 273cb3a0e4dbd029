"""The decoder families gapless serves: each a small declaration (its module here) over the
shared decoder (gpu_runner/model/). A checkpoint of another family is refused, naming it and
this list. Adding a family: a module with its Family, listed in FAMILIES, and its test against
transformers (tests/gpu_runner/test_families.py)."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterable, Iterator

from gapless.common.families.base import (
    BadField,
    Family,
    GGUFMeta,
    ModelArch,
    gguf_experts,
    gguf_shapes,
    shapes,
)
from gapless.common.families.checks import check_arch, gguf_key, hf_key
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


@contextlib.contextmanager
def naming(source: str, key: Callable[[str], str]) -> Iterator[None]:
    """A BadField, or a value of the wrong kind, raised in the block as a ValueError that names
    the file and the file's key for the field."""
    try:
        yield
    except BadField as e:
        raise ValueError(f"{source}: {key(e.field)} {e.why}") from None
    except KeyError as e:
        raise ValueError(f"{source}: {e.args[0]} is missing") from None
    except (TypeError, ZeroDivisionError, OverflowError) as e:
        raise ValueError(f"{source}: a value of the wrong kind ({e})") from None


def layers_in(names: Iterable[str], prefix: str) -> int:
    """How many layers a file's tensor names hold: the distinct N of `prefix`N. (n layers need
    n of them, however high one name claims to be)."""
    pattern = re.compile(re.escape(prefix) + r"(\d+)\.")
    found = (pattern.match(name) for name in names)
    return len({m.group(1) for m in found if m})


def _bound_layers(fields: dict, held: int | None, where: str) -> None:
    """Refuse a layer count beyond the layers the weights hold, by arithmetic, before the
    family builds any per-layer list."""
    n = fields["num_layers"]
    if held is not None and n > held:
        raise BadField("num_layers", f"{n}: {where} hold {held} layers")


def arch_from_config(raw: dict, source: str, held_layers: int | None = None) -> ModelArch:
    """The decoder of a config.json (`source` names it), its numbers checked; held_layers: the
    layers the weights hold, where known (model_check.py), which the config may not pass."""
    fam, config = read_config(raw, source)
    with naming(source, lambda field: hf_key(field, config)):
        fields = shapes(config)
        _bound_layers(fields, held_layers, "the safetensors")
        arch = ModelArch(architecture=fam.name, **{**fields, **fam.options(config)})
        check_arch(arch, fam.moe)
    return arch


def arch_from_gguf(meta: GGUFMeta, vocab_size: int) -> ModelArch:
    """The decoder of a GGUF file's metadata, its numbers checked (its block count against
    the blocks its tensors hold)."""
    fam = for_gguf(meta.arch, bool(meta.metadata.get(f"{meta.arch}.expert_count")), meta.path)
    with naming(meta.path, lambda field: gguf_key(field, meta.arch)):
        fields = gguf_shapes(meta, vocab_size)
        # a file of no tensors (a tokenizer's header) holds no layers to bound the count by;
        # loading weights from it fails on the names (model_check.py)
        held = layers_in(meta.tensors, "blk.") if meta.tensors else None
        _bound_layers(fields, held, "its tensors")
        fields.update(gguf_experts(meta))
        fields.update(fam.gguf_options(meta))
        renormalize = meta.metadata.get(f"{meta.arch}.expert_weights_norm")
        if renormalize is not None:  # newer llama.cpp files say it; older ones by architecture
            fields["norm_topk_prob"] = bool(renormalize)
        arch = ModelArch(architecture=fam.name, **fields)
        check_arch(arch, fam.moe)
    return arch
