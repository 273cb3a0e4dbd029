"""Which LoRA adapters' requests may take a seat (docs/lora.md).

A request may take a seat when its adapter is in the runner's host memory (`ready`) and the
running set uses fewer than max_loras adapters, or uses its adapter already: so a step never
mixes more than max_loras adapters, and the runner always has a stack entry free for the
adapter of a new slot. A request that may not waits here, out of the policy's queue, until it
may: it holds no request behind it and is charged nothing meanwhile; it keeps its place in line
(its arrival order) when it goes back.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterator

from gapless.core.request import Request


class LoraSeats:
    def __init__(self, max_loras: int, ready: tuple[str, ...] = ()) -> None:
        self.max_loras = max_loras
        # adapters in the runner's host memory, the least recently seated first
        self.ready: OrderedDict[str, None] = OrderedDict.fromkeys(ready)
        self.running: Counter[str] = Counter()  # adapter -> requests holding a seat
        self.held: dict[str, list[Request]] = {}  # adapter -> its requests waiting here
        # (tenant, adapter, prompt tokens computed, outputs) of adapter requests that ended,
        # until the metrics take them
        self.ended: list[tuple[str, str, int, int]] = []

    def admits(self, name: str) -> bool:
        """Whether a request of adapter name ("" : the base) may take a seat now."""
        if not name:
            return True
        return name in self.ready and (name in self.running or len(self.running) < self.max_loras)

    def hold(self, req: Request) -> None:
        self.held.setdefault(req.lora, []).append(req)

    def unhold(self, req: Request) -> bool:
        """Take req out if it waits here; whether it did."""
        queue = self.held.get(req.lora)
        if queue is None or req not in queue:
            return False
        queue.remove(req)
        if not queue:
            del self.held[req.lora]
        return True

    def release(self) -> list[Request]:
        """The requests whose adapter may take a seat now, no longer held."""
        out: list[Request] = []
        for name in [n for n in self.held if self.admits(n)]:
            out += self.held.pop(name)
        return out

    def waiting(self) -> Iterator[Request]:
        for queue in self.held.values():
            yield from queue

    @property
    def num_held(self) -> int:
        return sum(len(q) for q in self.held.values())

    def add_ready(self, name: str) -> None:
        self.ready[name] = None
        self.ready.move_to_end(name)

    def forget(self, name: str) -> None:
        """name's weights are not in host memory any more."""
        self.ready.pop(name, None)

    def seated(self, req: Request) -> None:
        if req.lora:
            self.running[req.lora] += 1
            self.ready.move_to_end(req.lora)

    def left(self, req: Request) -> None:
        if req.lora:
            self.running[req.lora] -= 1
            if not self.running[req.lora]:
                del self.running[req.lora]

    def finished(self, req: Request) -> None:
        if req.lora:
            self.ended.append((req.tenant, req.lora, req.prompt_charged, req.num_outputs))
