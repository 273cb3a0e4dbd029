"""The safetensors headers of a Hugging Face directory: each tensor's dtype, shape and byte
range, read without its data and held to the file's size.

A safetensors file is an 8-byte little-endian header length, that many bytes of JSON
({name: {"dtype", "shape", "data_offsets": [begin, end]}}, offsets from the end of the header),
then the data. The library checks the same things when it opens a file, but with an error that
names neither the file nor the tensor, and only when the runner loads it.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import msgspec

MAX_HEADER_BYTES = 100_000_000  # the safetensors library's own cap
ITEM_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
              "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1,
              "F8_E5M2": 1}  # fmt: skip
FLOATS = ("F64", "F32", "F16", "BF16")  # the dtypes the loader converts to the model's


class SafeTensor(msgspec.Struct, frozen=True):
    name: str  # as the file names it
    dtype: str  # "F32", "BF16", ...
    shape: tuple[int, ...]
    file: str


def _shape(value: object) -> tuple[int, ...] | None:
    ok = isinstance(value, list) and all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in value
    )
    return tuple(value) if ok else None  # type: ignore[arg-type]


def read_safetensors(path: str | Path) -> dict[str, SafeTensor]:
    """Every tensor of one file, by its name there; ValueError naming the file and the tensor
    when the header is not JSON or a tensor's bytes do not fit its shape or the file."""
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        f.seek(0)
        if size < 8:
            raise ValueError(f"{path}: {size} bytes, too short for a safetensors header")
        (n,) = struct.unpack("<Q", f.read(8))
        if n > min(size - 8, MAX_HEADER_BYTES):
            raise ValueError(f"{path}: a header of {n} bytes in a file of {size} (truncated?)")
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise ValueError(f"{path}: the header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: the header is not a JSON object")
    data = size - 8 - n  # bytes after the header
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        entry = entry if isinstance(entry, dict) else {}
        dtype, shape, offsets = (
            entry.get("dtype"),
            _shape(entry.get("shape")),
            entry.get("data_offsets"),
        )
        if dtype not in ITEM_BYTES or shape is None:
            raise ValueError(
                f"{path}: tensor {name!r} has dtype {dtype!r}, shape {entry.get('shape')}"
            )
        nbytes = math.prod(shape) * ITEM_BYTES[dtype]
        if not (
            isinstance(offsets, list)
            and len(offsets) == 2
            and all(isinstance(x, int) for x in offsets)
        ):
            raise ValueError(f"{path}: tensor {name!r} has data_offsets {offsets!r}")
        begin, end = offsets
        if not 0 <= begin <= end <= data or end - begin != nbytes:
            raise ValueError(
                f"{path}: tensor {name!r} {list(shape)} {dtype} is {nbytes} bytes, not its data "
                f"[{begin}, {end}) or not within the {data} after the header (truncated?)"
            )
        out[name] = SafeTensor(name, dtype, shape, str(path))
    return out


def _read_index(index: Path) -> dict[str, str]:
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map")
    except (ValueError, AttributeError) as e:
        raise ValueError(f"{index}: not a JSON object with a weight_map ({e})") from None
    if not isinstance(weight_map, dict):
        raise ValueError(f"{index}: weight_map is not an object")
    return weight_map


def read_safetensors_dir(path: Path) -> dict[str, SafeTensor]:
    """Every tensor of a directory's safetensors (those its model.safetensors.index.json names,
    else every *.safetensors), by the name the files give it."""
    index = path / "model.safetensors.index.json"
    files = sorted(set(_read_index(index).values())) if index.is_file() else None
    paths = [path / f for f in files] if files is not None else sorted(path.glob("*.safetensors"))
    out: dict[str, SafeTensor] = {}
    for file in paths:
        if not file.is_file():
            raise ValueError(f"{index}: names {file.name}, which is not in {path}")
        out.update(read_safetensors(file))
    return out
