"""A model's files held to its architecture before anything is built: `gapless serve` runs
check_model before it spawns a process, and the runner's loader check_weights before it reads
a byte of data.

Read from the headers alone (config.json, the safetensors headers, the GGUF metadata and tensor
directory): every tensor's data within its file, the architecture's numbers
(common/families/checks.py), its layer and expert counts against those the files hold, then
every parameter's name and shape. Counts are compared by arithmetic before any list is built
from them, so a config that claims 10^6 heads, layers or experts costs what its file costs to
read. Every problem is a ValueError naming the file and the field.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Callable
from pathlib import Path

import msgspec

from gapless.common import families
from gapless.common.families import ModelArch
from gapless.common.families.base import BadField
from gapless.common.families.checks import gguf_key, hf_key
from gapless.common.gguf_file import GGUFFile, read_gguf
from gapless.common.model_files import gguf_meta, gguf_vocab_size, read_json
from gapless.common.parameters import GGUF_SKIPPED, hf_name, iter_parameters
from gapless.common.safetensors_file import FLOATS, read_safetensors_dir


class Held(msgspec.Struct, frozen=True):
    """One tensor as a file holds it, under our name."""

    shape: tuple[int, ...]
    file: str
    name: str  # the file's own name for it
    dtype: str = ""  # safetensors' dtype; "" for GGUF (dequantized whatever its type)


class Naming(msgspec.Struct, frozen=True):
    """Where the architecture's numbers come from, to name them in a message."""

    source: str  # config.json's path, or the GGUF file's
    key: Callable[[str], str]  # ModelArch field -> the file's key


def check_model(path: str | Path) -> ModelArch:
    """The architecture of the model at path (a Hugging Face directory or a .gguf file), its
    files held to it; ValueError naming the file and the field."""
    path = Path(path)
    if path.is_dir():
        return _check_hf(path)
    gguf = read_gguf(path)
    name = str(gguf.metadata.get("general.architecture"))
    arch = families.arch_from_gguf(gguf_meta(gguf), gguf_vocab_size(gguf, name))
    check_weights(path, arch, gguf)
    return arch


def _check_hf(path: Path) -> ModelArch:
    config_path = path / "config.json"
    raw = read_json(config_path)
    fam, _ = families.read_config(raw, str(config_path))
    held = safetensors_held(path, fam.renames)
    layers = families.layers_in(held, "model.layers.")
    arch = families.arch_from_config(raw, str(config_path), held_layers=layers)
    check_weights(path, arch, held=held)
    return arch


def check_weights(
    path: str | Path, arch: ModelArch, gguf: GGUFFile | None = None, held: dict | None = None
) -> dict[str, Held]:
    """The tensors of the model at path, by our names, each parameter arch needs among them
    with its shape; ValueError naming the file, the tensor and the fields that size it."""
    path = Path(path)
    fam = families.family(arch.architecture)
    if path.is_dir():
        config = read_json(path / "config.json")
        _, config = families.read_config(config, str(path / "config.json"))
        naming = Naming(str(path / "config.json"), lambda field: hf_key(field, config))
        held = held if held is not None else safetensors_held(path, fam.renames)
        joined, stacked = fam.fused, False
    else:
        gguf = gguf if gguf is not None else read_gguf(path)
        check_gguf_data(gguf)
        name = str(gguf.metadata.get("general.architecture"))
        naming = Naming(str(path), lambda field: gguf_key(field, name))
        held = gguf_held(gguf, fam.gguf_names)
        joined, stacked = "blk.0.attn_qkv.weight" in gguf.tensors, True
    _check_expert_count(arch, held, stacked, naming)
    _check_parameters(arch, held, naming, fam.fused, joined, stacked)
    return held


def safetensors_held(path: Path, renames: tuple[tuple[str, str], ...]) -> dict[str, Held]:
    out = {}
    for name, t in read_safetensors_dir(path).items():
        ours = name
        for old, new in renames:
            ours = ours.replace(old, new)
        out[ours] = Held(t.shape, t.file, name, t.dtype)
    return out


def gguf_held(gguf: GGUFFile, arch_names: dict[str, str]) -> dict[str, Held]:
    out = {}
    for gguf_name, t in gguf.tensors.items():
        name = hf_name(gguf_name, arch_names)
        if name is None and gguf_name not in GGUF_SKIPPED:
            raise ValueError(f"{gguf.path}: tensor {gguf_name!r} has no known meaning")
        if name is not None:
            out[name] = Held(t.shape, gguf.path, gguf_name)
    return out


def check_gguf_data(gguf: GGUFFile) -> None:
    """Every tensor's type known, its rows whole blocks of it, its data within the file."""
    from gguf.constants import GGML_QUANT_SIZES  # why here: the frontend never needs it

    with open(gguf.path, "rb") as f:
        size = f.seek(0, 2)
    for name, t in gguf.tensors.items():
        sizes = GGML_QUANT_SIZES.get(t.qtype)  # type: ignore[call-overload]
        if sizes is None or not t.shape:
            raise ValueError(f"{gguf.path}: tensor {name!r} has type {t.qtype}, shape {t.shape}")
        block, block_bytes = sizes
        if t.shape[-1] % block:
            raise ValueError(
                f"{gguf.path}: tensor {name!r} {list(t.shape)}: rows of {t.shape[-1]} are not "
                f"whole blocks of {block} (type {t.qtype})"
            )
        end = t.offset + math.prod(t.shape) // block * block_bytes
        if end > size:
            raise ValueError(
                f"{gguf.path}: tensor {name!r} {list(t.shape)} has its data at bytes "
                f"[{t.offset}, {end}), past the end of the file ({size} bytes; truncated?)"
            )


def _indices(held: dict[str, Held], pattern: str) -> set[int]:
    """The distinct numbers the tensor names hold at the pattern's group: n layers (or
    experts) need n of them, however high one claims to be."""
    found = (re.search(pattern, name) for name in held)
    return {int(m.group(1)) for m in found if m}


def _check_expert_count(
    arch: ModelArch, held: dict[str, Held], stacked: bool, naming: Naming
) -> None:
    """Experts one file each (safetensors) no more than the files hold, before listing them."""
    if stacked or not any(arch.is_moe(i) for i in range(arch.num_layers)):
        return
    experts = len(_indices(held, r"\.experts\.(\d+)\."))
    if arch.num_experts > experts:
        with families.naming(naming.source, naming.key):
            raise BadField(
                "num_experts", f"{arch.num_experts}: the safetensors hold {experts} experts"
            )


def _check_parameters(
    arch: ModelArch,
    held: dict[str, Held],
    naming: Naming,
    fused: bool,
    joined: bool,
    stacked: bool,
) -> None:
    # why a cap: a parameter more than the files hold is already one too many to find
    wanted = list(itertools.islice(iter_parameters(arch, fused, joined, stacked), len(held) + 1))
    if len(wanted) > len(held):
        raise ValueError(
            f"{naming.source}: the architecture needs more than the {len(held)} tensors its "
            f"weights hold ({_fields(arch, naming, ('num_layers', 'num_experts'))})"
        )
    missing = [name for name, _ in wanted if name not in held]
    if missing:
        files = sorted({h.file for h in held.values()}) or [naming.source]
        raise ValueError(
            f"{', '.join(files)}: {len(missing)} tensors the architecture needs are missing, "
            f"e.g. {missing[:3]}"
        )
    for name, param in wanted:
        h = held[name]
        if h.shape != param.shape:
            raise ValueError(
                f"{h.file}: tensor {h.name!r} is {list(h.shape)}, but "
                f"{_fields(arch, naming, param.fields)} in {naming.source} make it "
                f"{list(param.shape)}"
            )
        if h.dtype and h.dtype not in FLOATS:
            raise ValueError(f"{h.file}: tensor {h.name!r} is {h.dtype}, not a float type")


def _fields(arch: ModelArch, naming: Naming, fields: tuple[str, ...]) -> str:
    return ", ".join(f"{naming.key(f)} {getattr(arch, f)}" for f in fields)
