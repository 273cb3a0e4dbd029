"""Quantized linear layers on cpu: weight-only int8 and int4 over torch's own kernels, and
w8a8, int8 x int8 products through fbgemm (W8A8Linear); int4-dual, the --dtype weights for
large steps beside an int4 copy for small ones (DualLinear).

Decode at small batch reads every weight once a token, so its speed is the weights' bytes.
`--quantization int8` keeps each output row as int8 with one scale (aten._weight_int8pack_mm);
`int4` keeps groups of 32 input columns as 4-bit codes with a scale and an offset
(aten._weight_int4pack_mm_for_cpu), which is exactly GGUF's Q4_1 block: w = d * q + m with
q in 0..15 equals (q - 8) * d + (m + 8 d), the kernel's form, so a Q4_1 file loses nothing.
Weights a format cannot hold exactly are quantized from their float values (int8: per row,
symmetric; int4: per group of 32, min to max). The output layer stays int8 under int4: tied
to a Q8_0 embedding, 4 bits would lose what the file has. Activations keep --dtype outside
these layers; inside, the weight-only kernels run in bfloat16 (KERNEL_DTYPE), and fbgemm's
w8a8 takes float32.
"""

from __future__ import annotations

import itertools
import logging
import warnings
import weakref
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from torch import nn

from gapless.common import families
from gapless.common.model_files import ModelArch, read_gguf
from gapless.gpu_runner.cpu import kernels
from gapless.gpu_runner.model import FUSED
from gapless.gpu_runner.model.projection import PROJECTIONS, wrap_projections

log = logging.getLogger("gapless.gpu_runner")

GROUP = 32  # int4 group size: Q4_1's block
Q4_1_BLOCK_BYTES = 20  # fp16 d, fp16 m, 16 bytes of 32 nibbles
# why: torch's int8 / int4 cpu kernels are fast in bfloat16 only; with float32 inputs they are
# several to tens of times slower, and slower than float32 weights. So a float32 model converts
# a quantized layer's input to bfloat16 and its output back, and keeps float32 elsewhere
# (attention, norms, the KV cache), which on a CPU without bfloat16 instructions is the faster
# step (`python -m gapless.bench.floor`, `python -m gapless.bench.cpu_step`; bench/RESULTS.md,
# "int8 weights, float32 activations").
KERNEL_DTYPE = torch.bfloat16
# why: the int8 kernel's time grows with its rows much faster than BLAS's. Past DENSE_ROWS
# rows (eager calls only: prefill chunks, --no-compile), an int8 layer widens its weight to
# the activations' dtype (q * scale, the same weights) and calls F.linear, which is faster from
# there on (`python -m gapless.bench.floor --batch 32 64 128 512 --format int8-fp32 fp32`;
# bench/RESULTS.md, "int8 weights, float32 activations").
DENSE_ROWS = 64
# False: int8 / int4 layers keep torch's kernels for single rows too (to compare; see
# Int8Linear, Int4Linear)
INT8_VNNI = True
INT4_VNNI = True
# why 63: on x86 without VNNI, fbgemm multiplies 8-bit activations (0..255) by 8-bit weights
# pairwise into 16 bits, which saturate past 32767; 2 * 255 * 63 cannot. The alternative, 7-bit
# activations (fbgemm's reduce_range), cost the default model many times the perplexity of 7-bit
# weights and 8-bit activations (`python -m gapless.bench.perplexity`; bench/RESULTS.md, "w8a8").
W8A8_TOP = 63
# why 16: up to here int4 weights take the default model's matmuls faster than bfloat16 ones
# where bfloat16 is native, past it slower (`python -m gapless.bench.floor --batch 1 2 4 8 16
# 32 --format int4 bf16`; bench/RESULTS.md, "int4-dual")
SMALL_ROWS = 16
QUANTIZED = PROJECTIONS  # the layers quantization swaps, besides the output layer


class Int8Linear(nn.Module):
    """y = x W^T (+ b), W [N, K] int8 with one scale per output row.

    A single row, where the CPU has AVX-512 VNNI, goes through gapless::int8_vnni_mm
    (gpu_runner/cpu/int8_matvec.cpp), which quantizes the row to 8 bits per block of 32 and takes
    int8 x int8 products; it keeps its own copy of the weights, biased to uint8 (`vnni`).
    why: torch's weight-only kernel widens each weight to float, and at one row that is most
    of its time, which this kernel saves (bench/RESULTS.md, "one stream's step"). At 2 to 16
    rows torch's kernel is as fast or faster, so it keeps them.
    The copy doubles an int8 layer's bytes in memory (the output layer: +28 MB), never those
    a step reads."""

    def __init__(self, weight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.register_buffer("weight", weight)  # [N, K] int8
        self.register_buffer("scales", scales)  # [N], KERNEL_DTYPE
        self.bias = bias
        vnni = INT8_VNNI and weight.shape[1] % 64 == 0 and kernels.has_vnni("int8_vnni_mm")
        biased = (weight.to(torch.int16) + 128).to(torch.uint8) if vnni else None
        self.register_buffer("vnni", biased)  # [N, K] uint8, weight + 128; or None
        self.register_buffer("vnni_scales", scales.float() if vnni else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        flat = x.reshape(-1, x.shape[-1])
        if flat.shape[0] > DENSE_ROWS and not torch.compiler.is_compiling():
            # a prefill chunk: the weights widened once beat the kernel's rows (DENSE_ROWS)
            w = self.weight.to(x.dtype) * self.scales.to(x.dtype)[:, None]
            y = F.linear(x, w)
            return y if self.bias is None else y + self.bias
        if self.vnni is not None and flat.shape[0] == 1:
            y = torch.ops.gapless.int8_vnni_mm(flat, self.vnni, self.vnni_scales)
        else:
            y = torch.ops.aten._weight_int8pack_mm(flat.to(KERNEL_DTYPE), self.weight, self.scales)
        y = y.view(*lead, self.weight.shape[0]).to(x.dtype)  # why not -1: a step may have 0 rows
        return y if self.bias is None else y + self.bias


class Int4Linear(nn.Module):
    """y = x W^T (+ b), W in groups of 32 input columns: (q - 8) * scale + zero, q 4 bits.

    A single row, where the CPU has AVX-512 VNNI, goes through gapless::int4_vnni_mm
    (gpu_runner/cpu/int4_matvec.cpp), which quantizes the row to 8 bits per block of 32 (as
    llama.cpp's Q4_1 x Q8_1 products do) and takes 4-bit x 8-bit products from its own copy
    of the codes (`vnni_codes`, d and m float16 as in the file; +66 MB for the default model).
    why: one stream served through HTTP decodes faster with it than with torch's kernel.
    Quiet, alone, the two kernels take the same time in a step: the gain is beside the
    server's other processes, where torch's kernel, split in halves, waits for the half of a
    thread the OS parked, and this one's last tiles go to whichever thread is free. What it
    costs: a little decode perplexity (`python -m gapless.bench.perplexity --decode`). At 2 or
    more rows torch's kernel is faster, so it keeps them (bench/RESULTS.md, "the int4 layers'
    single row through a VNNI kernel")."""

    def __init__(
        self,
        packed: torch.Tensor,
        scales_zeros: torch.Tensor,
        bias: torch.Tensor | None,
        vnni: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ):
        super().__init__()
        self.register_buffer("packed", packed)  # [N, K / 2] uint8, the kernel's layout
        self.register_buffer("scales_zeros", scales_zeros)  # [K / 32, N, 2], KERNEL_DTYPE
        self.bias = bias
        codes, d, m = vnni if vnni is not None else (None, None, None)
        self.register_buffer("vnni_codes", codes)  # [N, K / 2] uint8, int4_vnni_codes' order
        self.register_buffer("vnni_d", d)  # [N, K / 32] float16
        self.register_buffer("vnni_m", m)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        flat = x.reshape(-1, x.shape[-1])
        if self.vnni_codes is not None and flat.shape[0] == 1:
            y = torch.ops.gapless.int4_vnni_mm(flat, self.vnni_codes, self.vnni_d, self.vnni_m)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                flat.to(KERNEL_DTYPE), self.packed, GROUP, self.scales_zeros
            )
        y = y.view(*lead, self.scales_zeros.shape[1]).to(x.dtype)
        return y if self.bias is None else y + self.bias


class DualLinear(nn.Module):
    """A layer held twice: `dense` (the --dtype weights, F.linear) for steps of more than
    SMALL_ROWS rows, `small` (a quantized copy of the same weights) for the others. Small
    steps read a quarter of the bytes; large ones keep the dense matmul's speed."""

    def __init__(self, dense: nn.Linear, small: nn.Module):
        super().__init__()
        self.dense = dense
        self.small = small

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        return self.small(x) if rows <= SMALL_ROWS else self.dense(x)


# W8A8Linear's packed weights, by handle. The compiler cannot trace fbgemm's packed object, so
# the op it sees takes tensors only; the packed weights never leave this process.
# A layer's entry goes with the layer.
PACKED: dict[int, object] = {}
_HANDLES = itertools.count()


# why a plain library op rather than torch.library.custom_op: the compiled step calls it for
# every quantized layer, and custom_op's Python wrappers cost more a call than fbgemm's matmul
# of a small layer (bench/RESULTS.md, "w8a8")
_LIB = torch.library.Library("gapless", "FRAGMENT")
_LIB.define("w8a8_linear(Tensor x, Tensor handle, Tensor scales) -> Tensor")
_LINEAR_DYNAMIC = torch.ops.quantized.linear_dynamic.default


def _w8a8_linear(x: torch.Tensor, handle: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [M, K] float32 -> [M, N]: fbgemm's dynamic int8 matmul with the weights of `handle`."""
    return _LINEAR_DYNAMIC(x, PACKED[int(handle.item())], False)


_LIB.impl("w8a8_linear", _w8a8_linear, "CPU")


@torch.library.register_fake("gapless::w8a8_linear")
def _(x: torch.Tensor, handle: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], scales.shape[0])


class W8A8Linear(nn.Module):
    """y = x W^T (+ b) on int8 x int8 products: W int8 in -63..63 with one scale per output
    row; x quantized at each call, per row, to 8 bits (fbgemm's dynamic quantized linear).
    A single row goes through `one_row`, the weight-only int8 layer of the same weights."""

    def __init__(
        self,
        weight: torch.Tensor,
        scales: torch.Tensor,
        bias: torch.Tensor | None,
        one_row: Int8Linear,
    ):
        super().__init__()
        self.one_row = one_row
        assert -W8A8_TOP <= int(weight.min()) and int(weight.max()) <= W8A8_TOP, (
            "weights in -63..63"
        )
        zero = torch.zeros(weight.shape[0], dtype=torch.long)
        # why not quantize_per_channel: it rounds float weights again, over a hundred times
        # slower than taking the int8 values as they are, seconds of a start
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # torch's quantized tensors are old
            qweight = torch._make_per_channel_quantized_tensor(weight, scales.double(), zero, 0)
        self.packed = torch.ops.quantized.linear_prepack(qweight, None)
        handle = next(_HANDLES)
        PACKED[handle] = self.packed
        weakref.finalize(self, PACKED.pop, handle, None)
        self.register_buffer("handle", torch.tensor(handle))
        self.register_buffer("scales", scales.float())  # [N]
        self.in_features = weight.shape[1]
        self.bias = bias

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] float32, rows already scaled -> [M, N]: fbgemm's call alone, eagerly."""
        return _LINEAR_DYNAMIC(x, self.packed, False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        flat = x.reshape(-1, x.shape[-1])
        if flat.shape[0] == 1:
            # why: fbgemm's dynamic matmul has a fixed cost a call whatever its size, several
            # times the weight-only kernel's at one row, and a step calls it for every layer
            # (bench/RESULTS.md, "w8a8"). It costs a second int8 copy of the weights.
            return self.one_row(x)
        flat = flat.float()
        # why each row scaled to 1 first: fbgemm quantizes the whole input with one scale, and
        # one token's outlier (the first of a prompt) would take the other rows' precision
        row = flat.abs().amax(-1, keepdim=True).clamp(min=1e-12)
        if torch.compiler.is_compiling():
            y = torch.ops.gapless.w8a8_linear(flat / row, self.handle, self.scales)
        else:
            y = self.matmul(flat / row)
        y = (y * row).view(*lead, self.scales.shape[0]).to(x.dtype)
        return y if self.bias is None else y + self.bias


def make_w8a8(w: torch.Tensor, bias: torch.Tensor | None) -> W8A8Linear:
    """W8A8Linear of float weights w [N, K], with its weight-only layer for single rows."""
    q, scale = int8_rows(w)
    return W8A8Linear(*int8_rows(w, W8A8_TOP), bias, Int8Linear(q, scale.to(KERNEL_DTYPE), bias))


def int8_rows(w: torch.Tensor, top: int = 127) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] float -> (int8 [N, K] in -top..top, scale [N] float32), symmetric per row."""
    w = w.float()
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / top
    q = torch.round(w / scale[:, None]).clamp_(-top, top).to(torch.int8)
    return q, scale


def int4_groups(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] float -> (codes [N, K] uint8 in 0..15, d [N, K/32], m [N, K/32]): w ~ d q + m."""
    n, k = w.shape
    g = w.float().view(n, k // GROUP, GROUP)
    low, high = g.amin(-1), g.amax(-1)
    d = ((high - low) / 15.0).clamp(min=1e-12)
    q = torch.round((g - low[..., None]) / d[..., None]).clamp_(0, 15).to(torch.uint8)
    return q.view(n, k), d, low


def int4_vnni_codes(q: torch.Tensor) -> torch.Tensor:
    """codes q [N, K] in 0..15 -> [N, K / 2] uint8 in gapless::int4_vnni_mm's order: per group
    of G <= 16 blocks of 32, 8 steps of 4G bytes (step k: bytes 4k..4k+3 of each block), steps
    2j and 2j + 1 sharing a byte as its low and high nibble."""
    n, k = q.shape
    blocks = q.view(n, k // GROUP, GROUP)
    groups = []
    for g0 in range(0, k // GROUP, 16):
        part = blocks[:, g0 : g0 + 16]  # [N, G, 32]
        steps = part.reshape(n, part.shape[1], 8, 4).transpose(1, 2).reshape(n, 8, -1)
        groups.append((steps[:, 0::2] | (steps[:, 1::2] << 4)).reshape(n, -1))
    return torch.cat(groups, dim=1).contiguous()


def make_int4(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor, bias) -> Int4Linear:
    """Int4Linear of w = d * q + m per group of 32: q [N, K] in 0..15, d and m [N, K/32]."""
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
    zeros = m.float() + 8.0 * d.float()
    scales_zeros = torch.stack([d.float(), zeros], dim=-1).transpose(0, 1).contiguous()
    vnni = None
    if INT4_VNNI and kernels.has_vnni("int4_vnni_mm"):
        vnni = (int4_vnni_codes(q), d.half().contiguous(), m.half().contiguous())
    return Int4Linear(packed, scales_zeros.to(KERNEL_DTYPE), bias, vnni)


def q4_1_blocks(path: Path, arch: ModelArch) -> dict[str, tuple[torch.Tensor, ...]]:
    """HF name -> (q [N, K] uint8, d [N, K/32], m [N, K/32] float32) of every Q4_1 tensor of a
    GGUF file, with llama's Q/K rows put back in Hugging Face's order as the loader does."""
    from gapless.gpu_runner.model.weights import hf_name, unpermuted

    gguf = read_gguf(path)
    arch_names = families.family(arch.architecture).gguf_names
    raw = np.memmap(gguf.path, dtype=np.uint8, mode="r")
    out = {}
    for gguf_name, t in gguf.tensors.items():
        name = hf_name(gguf_name, arch_names)
        if name is None or t.qtype != GGMLQuantizationType.Q4_1 or len(t.shape) != 2:
            continue
        n, k = t.shape
        nbytes = n * k // GROUP * Q4_1_BLOCK_BYTES
        blocks = np.asarray(raw[t.offset : t.offset + nbytes]).reshape(n, k // GROUP, 20)
        d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)  # [N, K/32]
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        nib = blocks[..., 4:]  # [N, K/32, 16]: element j low nibble, element j + 16 high
        q = np.concatenate([nib & 0x0F, nib >> 4], axis=-1).reshape(n, k)
        tensors = [torch.from_numpy(q.copy()), torch.from_numpy(d), torch.from_numpy(m)]
        tensors = [unpermuted(name, x, arch).contiguous() for x in tensors]
        out[name.removesuffix(".weight")] = tuple(tensors)
    return out


def _int4_blocks(model: nn.Module, name: str, weight: torch.Tensor, exact: dict) -> tuple:
    """(q, d, m) of layer `name`: the file's own blocks where it holds them, else weight's
    rows rounded to int4 groups. A fused layer takes each part's blocks on their own, so a
    file that holds some parts as Q4_1 keeps those exact."""
    fused = next((f for f in FUSED if name.endswith("." + f)), None)
    if fused is None or name in exact:  # a layer the file holds joined (Phi-3) is one tensor
        return exact.get(name) or int4_groups(weight)
    prefix = name[: -len(fused)]
    rows = weight.split(model.get_submodule(name.rsplit(".", 1)[0]).sizes, dim=0)
    parts = [prefix + part for part in FUSED[fused]]
    if exact and not all(p in exact for p in parts):
        log.info("%s: parts not held as Q4_1 in the file are rounded to int4", name)
    return _cat_blocks([exact.get(p) or int4_groups(w) for p, w in zip(parts, rows, strict=True)])


def _cat_blocks(parts: list[tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, ...]:
    """(q, d, m) of layers stacked along their rows: the (q, d, m) of the joined layer."""
    return tuple(torch.cat(column) for column in zip(*parts, strict=True))


def quantize_model(model: nn.Module, mode: str, model_path: str, arch: ModelArch) -> None:
    """Swap the decoder's linear layers (and the output layer) for quantized ones, in place.
    A mixture of experts' routed experts (stacked weights, not linear layers) and its router
    keep --dtype; its attention, shared expert and output layer are quantized."""
    if mode == "none":
        return
    if arch.num_experts:
        log.info("%s: the routed experts stay in %s, unquantized", mode,
                 str(model.lm_head.weight.dtype).removeprefix("torch."))  # fmt: skip
    assert mode in ("int8", "int4", "w8a8", "int4-dual"), f"unknown quantization {mode!r}"
    path = Path(model_path)
    exact = q4_1_blocks(path, arch) if mode.startswith("int4") and path.is_file() else {}

    def quantized(name: str, module: nn.Module) -> nn.Module:
        assert isinstance(module, nn.Linear), f"{name}: quantized twice"
        bias = None if module.bias is None else module.bias.detach()
        if mode == "int8":
            q, scale = int8_rows(module.weight.detach())
            return Int8Linear(q, scale.to(KERNEL_DTYPE), bias)
        if mode == "w8a8":
            return make_w8a8(module.weight.detach(), bias)
        q, d, m = _int4_blocks(model, name, module.weight.detach(), exact)
        new = make_int4(q, d, m, bias)
        return DualLinear(module, new) if mode == "int4-dual" else new

    wrap_projections(model, quantized)
    if mode == "w8a8":
        model.lm_head = make_w8a8(model.lm_head.weight.detach(), None)
        return
    q, scale = int8_rows(model.lm_head.weight.detach())
    head = Int8Linear(q, scale.to(KERNEL_DTYPE), None)
    model.lm_head = DualLinear(model.lm_head, head) if mode == "int4-dual" else head


def holds_q4_1(path: str | Path) -> bool:
    """Whether a model file is a GGUF with Q4_1 tensors (which int4 holds exactly)."""
    path = Path(path)
    if not path.is_file() or path.suffix != ".gguf":
        return False
    return any(t.qtype == GGMLQuantizationType.Q4_1 for t in read_gguf(path).tensors.values())
