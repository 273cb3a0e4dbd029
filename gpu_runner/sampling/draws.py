"""Counter-based randomness for the sampler: a hash of (seed, position, vocab id), so a seeded
row draws the same tokens whatever batch or slot it lands in, with no per-row generator state."""

from __future__ import annotations

import torch


def signed(value: int, bits: int) -> int:
    """The two's-complement reading of the low `bits` bits of value."""
    value &= (1 << bits) - 1
    return value - (1 << bits) if value >> (bits - 1) else value


_GOLDEN64 = signed(0x9E3779B97F4A7C15, 64)
_MIX64_A = signed(0xBF58476D1CE4E5B9, 64)
_MIX64_B = signed(0x94D049BB133111EB, 64)
_MIX32_A = signed(0x85EBCA6B, 32)
_MIX32_B = signed(0xC2B2AE35, 32)
UNSEEDED_SALT = signed(0xD1B54A32D192ED03, 64)


def _shr(x: torch.Tensor, shift: int, bits: int) -> torch.Tensor:
    """Logical right shift of a signed tensor: torch shifts arithmetically, so mask the sign."""
    return (x >> shift).bitwise_and_((1 << (bits - shift)) - 1)


def mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64 of each int64 element (multiplication and addition wrap mod 2**64)."""
    x = x + _GOLDEN64
    x = (x ^ _shr(x, 30, 64)) * _MIX64_A
    x = (x ^ _shr(x, 27, 64)) * _MIX64_B
    return x ^ _shr(x, 31, 64)


def fmix32_(x: torch.Tensor, final_shift: bool = True) -> torch.Tensor:
    """murmur3's 32-bit finalizer, in place on an int32 tensor (a bijection on 32 bits).

    Without final_shift the top 16 bits are the same and the rest differ by a bijection of the
    top bits, so callers that only read the top bits lose nothing by skipping it.
    """
    x ^= _shr(x, 16, 32)
    x *= _MIX32_A
    x ^= _shr(x, 13, 32)
    x *= _MIX32_B
    if final_shift:
        x ^= _shr(x, 16, 32)
    return x


def exponentials(keys: torch.Tensor, vocab_hash: torch.Tensor) -> torch.Tensor:
    """Exp(1) draws for every (row, vocab id): keys [B] int64, vocab_hash [V] int32 -> [B, V].

    Each row's key is already a full 64-bit hash; its high 32 bits are xored with a fixed hash
    of the vocab id and finalized, which is a bijection per row, so no two ids share a draw.
    """
    x = (keys >> 32).to(torch.int32)[:, None] ^ vocab_hash  # [B, V] int32
    fmix32_(x, final_shift=False)
    # top 23 bits, signed in [-2**22, 2**22); + 2**22 + 0.5 is exact in float32 and lies in
    # (0, 2**23), so u = w / 2**23 is exact and strictly inside (0, 1), and q = -log(u) > 0.
    # why not 23 log 2 - log(w): near u = 1 that difference rounds to 0, and probs / 0 gives
    # inf (an allowed token wins) or nan (a filtered-out token wins the argmax)
    w = (x >> 9).to(torch.float32).add_(2.0**22 + 0.5)  # [B, V] float32
    return w.mul_(2.0**-23).log_().neg_()
