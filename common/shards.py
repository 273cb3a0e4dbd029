"""How tensor parallelism splits a decoder over N ranks: attention heads in groups of K/V heads,
MLP rows and the vocabulary. Pure arithmetic (no torch): the CLI checks a split before any
process starts, and every rank computes its own share from the same numbers."""

from __future__ import annotations

from gapless.common.families.base import ModelArch


def even_range(n: int, size: int, rank: int) -> tuple[int, int]:
    """[start, end) of rank's share of n items split over size ranks, sizes differing by one."""
    return n * rank // size, n * (rank + 1) // size


def vocab_range(vocab: int, size: int, rank: int) -> tuple[int, int]:
    """[start, end) of rank's vocabulary rows: chunks of ceil(vocab / size), the last one
    shorter, so every rank's logits are one shape for the all-gather (padded)."""
    chunk = -(-vocab // size)
    return min(vocab, chunk * rank), min(vocab, chunk * (rank + 1))


def kv_head_range(num_kv_heads: int, size: int, rank: int) -> tuple[int, int]:
    """[start, end) of rank's K/V heads: a share of them, or the one head it replicates when
    there are fewer K/V heads than ranks (ranks r*K//N share a head)."""
    if num_kv_heads >= size:
        return even_range(num_kv_heads, size, rank)
    head = rank * num_kv_heads // size
    return head, head + 1


def q_head_range(num_heads: int, num_kv_heads: int, size: int, rank: int) -> tuple[int, int]:
    """[start, end) of rank's query heads: those of its K/V heads, split among the ranks that
    replicate one K/V head."""
    group = num_heads // num_kv_heads  # query heads per K/V head
    if num_kv_heads >= size:
        first, last = kv_head_range(num_kv_heads, size, rank)
        return first * group, last * group
    sharing = size // num_kv_heads  # ranks per K/V head
    head = rank // sharing
    start, end = even_range(group, sharing, rank % sharing)
    return head * group + start, head * group + end


def split_problem(arch: ModelArch, size: int) -> str | None:
    """Why `arch` cannot be split over `size` ranks, or None when it can."""
    if size == 1:
        return None
    k, h = arch.num_kv_heads, arch.num_heads
    if k < size and size % k:
        return f"{size} ranks cannot share the model's {k} K/V heads evenly (a multiple of {k})"
    if k < size and h // k < size // k:
        return f"the model's {h} attention heads are fewer than {size} ranks"
    inter = min(s for s in (arch.intermediate_size, arch.moe_intermediate_size,
                            arch.shared_expert_intermediate_size) if s)  # fmt: skip
    if inter < size or arch.vocab_size < size:
        return f"the model's layers are too small for {size} ranks"
    return None
