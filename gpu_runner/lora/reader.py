"""Adapters read at run time (POST /v1/load_lora_adapter, or again after --max-cpu-loras let
one go): the files are read and checked on a thread of their own, so no step waits for a disk;
what finished is kept on the stack between steps, from the runner's loop."""

from __future__ import annotations

from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

from safetensors import SafetensorError

from gapless.common.messages import AdapterRead, DropAdapter, ReadAdapter
from gapless.common.model_files import ModelArch
from gapless.gpu_runner.lora.adapter import Adapter, AdapterError, load_adapter
from gapless.gpu_runner.lora.stack import LoraStack


class AdapterReader:
    """`handle` a ReadAdapter or DropAdapter; `finished` returns the AdapterRead answers of the
    reads that ended, their adapters kept on `stack` (None on sim: read, checked, let go)."""

    def __init__(self, arch: ModelArch, max_rank: int, stack: LoraStack | None) -> None:
        self.arch = arch
        self.max_rank = max_rank
        self.stack = stack
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="gapless-lora-read")
        self._reads: dict[str, Future[Adapter]] = {}  # name -> its read, in order asked

    @property
    def busy(self) -> bool:
        return bool(self._reads)

    def handle(self, msg: ReadAdapter | DropAdapter) -> None:
        match msg:
            case ReadAdapter(name=name, path=path):
                self._reads[name] = self._pool.submit(load_adapter, name, path, self.arch,
                                                      self.max_rank)  # fmt: skip
            case DropAdapter(name=name):
                read = self._reads.pop(name, None)
                if read is not None:
                    read.cancel()
                if self.stack is not None:
                    self.stack.drop(name)

    def finished(self) -> list[AdapterRead]:
        answers = []
        for name, read in list(self._reads.items()):
            if not read.done():
                continue
            del self._reads[name]
            try:
                adapter = read.result()
            except AdapterError as e:
                answers.append(AdapterRead(name, str(e)))
            except (OSError, ValueError, RuntimeError, SafetensorError) as e:  # a broken file
                answers.append(AdapterRead(name, f"{name}: cannot read it: {e}"))
            else:
                if self.stack is not None:
                    self.stack.keep(adapter)
                answers.append(AdapterRead(name))
        return answers

    def wait(self, timeout_s: float) -> None:
        """Until a read ends or timeout_s passed (tests: the runner's loop never waits)."""
        wait(self._reads.values(), timeout_s, FIRST_COMPLETED)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
