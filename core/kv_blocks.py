"""Paged KV block accounting and runner slot accounting (pure CPU bookkeeping)."""

from __future__ import annotations

from collections import deque


class BlockManager:
    """Hands out KV block ids. Block 0 is reserved: padded entries on the runner write there."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        assert num_blocks >= 2, "need at least one usable KV block"
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(1, num_blocks))
        self._used = bytearray(num_blocks)  # 1 while a request holds the block

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_usable(self) -> int:
        return self.num_blocks - 1

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        assert self.can_allocate(n), "allocate without can_allocate"
        out = [self._free.popleft() for _ in range(n)]
        for b in out:
            self._used[b] = 1
        return out

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            assert self._used[b], f"double free of KV block {b}"
            self._used[b] = 0
        self._free.extend(blocks)


class SlotManager:
    """Seats in the runner's persistent batch. A freed slot is announced in the next plan."""

    def __init__(self, num_slots: int) -> None:
        self._free: deque[int] = deque(range(num_slots))
        self._freed_since_plan: list[int] = []

    def allocate(self) -> int:
        return self._free.popleft()

    def free(self, slot: int) -> None:
        assert slot not in self._free, f"double free of slot {slot}"
        self._free.append(slot)
        self._freed_since_plan.append(slot)

    def take_freed(self) -> list[int]:
        out, self._freed_since_plan = self._freed_since_plan, []
        return out
