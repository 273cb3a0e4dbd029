"""The LoRA adapters a core serves and where their weights are (docs/lora.md).

Adapters are loaded (POST /v1/load_lora_adapter) and unloaded by name. A loaded adapter's
weights are in the runner's host memory (`LoraSeats.ready`) or, past --max-cpu-loras, only on
disk: the least recently seated one with no request running or waiting is let go, and read
again when a request asks for it. The runner reads off its step thread and answers AdapterRead;
requests of an adapter being read wait in LoraSeats meanwhile.
"""

from __future__ import annotations

from gapless.common.config import EngineConfig
from gapless.common.messages import (
    AdapterRead,
    DropAdapter,
    LoadLora,
    LoraAdapters,
    ReadAdapter,
    RunnerInput,
    UnloadLora,
)
from gapless.core.lora import LoraSeats

Asker = tuple[int, int]  # (frontend id, token)


class AdapterBook:
    def __init__(self, config: EngineConfig, seats: LoraSeats) -> None:
        self.served = config.served_model_name
        self.num_frontends = config.api_servers
        self.max_cpu = config.max_cpu_loras
        self.seats = seats
        self.paths: dict[str, str] = dict(config.lora_modules)  # loaded: name -> directory
        self.reading: dict[str, tuple[str, Asker | None]] = {}  # name -> (path, who loads it)
        self.runner: list[RunnerInput] = []  # to send the runner, in order
        self.frontend: list[tuple[int, LoraAdapters]] = []  # to send frontends
        self.let_go()

    def load(self, msg: LoadLora) -> None:
        name, asker = msg.name, (msg.frontend_id, msg.token)
        if name == self.served or name in self.paths or name in self.reading:
            self._answer(asker, f"lora_name: an adapter or model named {name!r} is loaded already")
            return
        self.reading[name] = (msg.path, asker)
        self.runner.append(ReadAdapter(name, msg.path))

    def unload(self, msg: UnloadLora) -> bool:
        """Forget the adapter (False, and a 404 answer, if none is loaded by that name); its
        requests still waiting are the caller's to end."""
        name, asker = msg.name, (msg.frontend_id, msg.token)
        if name not in self.paths:
            self._answer(asker, f"lora_name: no adapter named {name!r} is loaded", 404)
            return False
        del self.paths[name]
        self.seats.forget(name)
        self.reading.pop(name, None)
        self.runner.append(DropAdapter(name))
        self._broadcast(asker)
        return True

    def read(self, msg: AdapterRead) -> list[str]:
        """The runner's answer; the adapters whose waiting requests must end (a read again that
        failed: the files changed under a loaded adapter)."""
        name = msg.name
        path, asker = self.reading.pop(name, ("", None))
        wanted = name in self.paths or asker is not None
        if not wanted:  # unloaded while it was read
            self.runner.append(DropAdapter(name))
            return []
        if msg.error:
            if asker is not None:
                self._answer(asker, msg.error)
                return []
            return [name]
        if asker is not None:
            self.paths[name] = path
        self.seats.add_ready(name)
        self.let_go()
        if asker is not None:
            self._broadcast(asker)
        return []

    def want(self) -> list[str]:
        """Read again the adapters that requests wait for and the runner let go; the adapters
        requests wait for that are not loaded any more (their requests must end)."""
        gone = []
        for name in self.seats.held:
            if name in self.reading:  # loaded or read again now
                continue
            if name not in self.paths:
                gone.append(name)
            elif name not in self.seats.ready:
                self.reading[name] = (self.paths[name], None)
                self.runner.append(ReadAdapter(name, self.paths[name]))
        return gone

    def let_go(self) -> None:
        """Past --max-cpu-loras, let the least recently used adapters no request needs go."""
        if self.max_cpu is None or len(self.seats.ready) <= self.max_cpu:
            return
        seats = self.seats
        ready = list(seats.ready)  # least recently seated first
        for name in ready[: max(0, len(ready) - self.max_cpu)]:
            if name not in seats.running and name not in seats.held:
                seats.forget(name)
                self.runner.append(DropAdapter(name))

    def _answer(self, asker: Asker, error: str, status: int = 400) -> None:
        self.frontend.append((asker[0], LoraAdapters(list(self.paths), asker[1], error, status)))

    def _broadcast(self, asker: Asker) -> None:
        """The new set to every frontend; to the asker as its answer."""
        names = list(self.paths)
        for fid in range(self.num_frontends):
            token = asker[1] if fid == asker[0] else -1
            self.frontend.append((fid, LoraAdapters(names, token)))
