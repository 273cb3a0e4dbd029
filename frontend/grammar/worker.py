"""A grammar worker: a process the frontend spawns to compile untrusted grammars, so that a
compile which runs away can be killed (frontend.grammar.pool drives it).

The protocol, on the worker's stdin and stdout, is frames of a 4-byte big-endian length and
that many bytes (never pickle):
- frontend -> worker: one `WorkerInit` (msgspec JSON), then one grammar (UTF-8) per frame;
- worker -> frontend: an empty frame once ready, then one verdict (UTF-8) per grammar: "" if it
  compiles within llguidance's limits, else why not.

The worker builds llguidance's tokenizer view once, then caps its own address space
(RLIMIT_AS) so that a compile past the cap aborts it (then stays quiet on stderr); it dies with the thread that spawned it
(PR_SET_PDEATHSIG) or once its parent is gone (a poll), and exits at the end of its input.
"""

from __future__ import annotations

import ctypes
import os
import resource
import signal
import struct
import sys
import threading
import time

import msgspec

HEADER = struct.Struct(">I")  # a frame's length in bytes
PARENT_POLL_S = 0.5


class WorkerInit(msgspec.Struct, frozen=True):
    tokenizer_json: str
    vocab_size: int
    eos: tuple[int, ...]
    memory_bytes: int  # address space allowed on top of what the ready worker holds


def write_frame(fd: int, payload: bytes) -> None:
    data = memoryview(HEADER.pack(len(payload)) + payload)
    while data:
        data = data[os.write(fd, data) :]


def read_exactly(fd: int, n: int) -> bytes | None:
    """n bytes from fd, or None at the end of input."""
    parts, left = [], n
    while left:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            return None
        parts.append(chunk)
        left -= len(chunk)
    return b"".join(parts)


def read_frame(fd: int) -> bytes | None:
    head = read_exactly(fd, HEADER.size)
    if head is None:
        return None
    (size,) = HEADER.unpack(head)
    return read_exactly(fd, size) if size else b""


def _die_with(parent: int) -> None:
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # it died before prctl
        os._exit(1)

    def watch() -> None:  # why too: PDEATHSIG is not on every platform
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _address_space() -> int:
    """Bytes of address space this process holds now (VmSize)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


def _cap_memory(extra: int) -> None:
    held = _address_space()
    if held and extra > 0:
        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        limit = held + extra if hard == resource.RLIM_INFINITY else min(hard, held + extra)
        resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


def main() -> None:
    from gapless.common.grammars import check_grammar, make_tokenizer

    _die_with(int(sys.argv[1]))
    replies = os.dup(1)
    os.dup2(2, 1)  # why: anything a library prints must not land in the reply stream
    first = read_frame(0)
    if first is None:
        return
    init = msgspec.json.decode(first, type=WorkerInit)
    view = make_tokenizer(init.tokenizer_json, init.vocab_size, init.eos)
    memory_bytes = init.memory_bytes
    del first, init
    _cap_memory(memory_bytes)
    write_frame(replies, b"")
    # why: a compile past the cap aborts with a backtrace on stderr; the frontend logs one line
    quiet = os.open(os.devnull, os.O_WRONLY)
    os.dup2(quiet, 1)
    os.dup2(quiet, 2)
    while (frame := read_frame(0)) is not None:
        try:
            verdict = check_grammar(frame.decode(), view)
        except MemoryError:
            verdict = "it needs more memory than a compile is allowed"
        except Exception as exc:  # llguidance's own refusals are verdicts too
            verdict = f"{type(exc).__name__}: {exc}"
        write_frame(replies, verdict.encode())


if __name__ == "__main__":
    main()
