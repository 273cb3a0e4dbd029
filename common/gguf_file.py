"""The GGUF header: metadata and the tensor directory, without reading tensor data.

gguf.GGUFReader parses every array element into its own numpy view, which takes ~5 s on
SmolLM2's 98k tokenizer strings; this reads the same header in ~0.1 s.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
            11: "<q", 12: "<d"}  # fmt: skip
_ARRAY_DTYPES = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?",
                 10: "<u8", 11: "<i8", 12: "<f8"}  # fmt: skip
_STRING, _ARRAY = 8, 9


class GGUFTensor(msgspec.Struct, frozen=True):
    name: str
    shape: tuple[int, ...]  # torch order: [out, in] (GGUF stores dims innermost first)
    qtype: int  # gguf.GGMLQuantizationType value
    offset: int  # absolute byte offset of the data in the file


class GGUFFile(msgspec.Struct, frozen=True):
    path: str
    metadata: dict[str, Any]  # arrays of numbers are numpy arrays, of strings lists
    tensors: dict[str, GGUFTensor]


class _Cursor:
    def __init__(self, buf: mmap.mmap) -> None:
        self.buf, self.pos = buf, 0

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.scalar("<Q")
        if self.pos + n > len(self.buf):
            raise ValueError(f"a string of {n} bytes at byte {self.pos}, past the end")
        text = self.buf[self.pos : self.pos + n].decode("utf-8")
        self.pos += n
        return text

    def value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            itype, count = self.scalar("<I"), self.scalar("<Q")
            if itype == _STRING:
                return [self.string() for _ in range(count)]
            if itype in _ARRAY_DTYPES:
                dtype = np.dtype(_ARRAY_DTYPES[itype])
                arr = np.frombuffer(self.buf, dtype, count, self.pos).copy()
                self.pos += count * dtype.itemsize
                return arr
            return [self.value(itype) for _ in range(count)]
        if vtype not in _SCALARS:
            raise ValueError(f"GGUF value type {vtype} is unknown")
        value = self.scalar(_SCALARS[vtype])
        return float(str(np.float32(value))) if vtype == 6 else value  # f32 1e-5, not 9.99e-06


def is_gguf(path: str | Path) -> bool:
    """Whether path is a regular file that starts as GGUF files do."""
    if not Path(path).is_file():  # why: opening a FIFO would block
        return False
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def read_gguf(path: str | Path) -> GGUFFile:
    """Metadata and tensor directory of a GGUF file (v2/v3), without reading tensor data;
    ValueError naming the file (and the field) when the header is cut short or impossible.
    Whether each tensor's data lies within the file is common/model_check.py's to say."""
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file (bad magic)")
        f.seek(0)
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            try:
                return _read(str(path), buf)
            except (struct.error, UnicodeDecodeError, ValueError) as e:
                if str(e).startswith(str(path)):
                    raise
                raise ValueError(f"{path}: the GGUF header is cut short or corrupt ({e})") from None


def _read(path: str, buf: mmap.mmap) -> GGUFFile:
    cur = _Cursor(buf)
    cur.pos = 4
    version = cur.scalar("<I")
    if version not in (2, 3):
        raise ValueError(f"{path}: GGUF version {version} is not supported (need 2 or 3)")
    num_tensors, num_kv = cur.scalar("<Q"), cur.scalar("<Q")
    metadata: dict[str, Any] = {}
    for _ in range(num_kv):
        key = cur.string()
        metadata[key] = cur.value(cur.scalar("<I"))
    infos = []
    for _ in range(num_tensors):
        name = cur.string()
        ndim = cur.scalar("<I")
        dims = [cur.scalar("<Q") for _ in range(ndim)]
        infos.append((name, tuple(reversed(dims)), cur.scalar("<I"), cur.scalar("<Q")))
    align = metadata.get("general.alignment", 32)
    # llama.cpp's rule: a power of two
    if not isinstance(align, int) or align <= 0 or align & (align - 1):
        raise ValueError(f"{path}: general.alignment {align!r} is not a positive power of two")
    data_start = (cur.pos + align - 1) // align * align
    tensors = {n: GGUFTensor(n, shape, qtype, data_start + off) for n, shape, qtype, off in infos}
    return GGUFFile(path, metadata, tensors)
