"""Compiles of untrusted grammars, in worker processes that can be stopped.

A GrammarPool owns `workers` slots, each a worker process (frontend.grammar.worker) and one
thread that talks to it over pipes, so a compile never holds a thread that chat templates or
tokenizing need. A compile that passes its deadline, or its worker's memory cap, ends with that
worker killed and a fresh one spawned; the request gets a verdict saying why.

Fair between tenants, however many: at most `workers` compiles run at once and one tenant runs
at most half of them (at least one); a free worker goes to the waiting tenant with the fewest
compiles running, then to the one served least recently, not first come first served. At most
MAX_WAITING_PER_WORKER per worker wait, and a tenant's share of those places is the total over
the tenants running or waiting; a tenant with nothing waiting always finds a place (the newest
place of the tenant holding the most is taken for it). A tenant with nothing running that waits
while every worker runs a compile of a tenant above its fair share of workers takes the worker
whose compile has run longest, once that compile has run PREEMPT_AFTER_S: the stopped compile
ends with `Busy` (429, retry), the worker is replaced, and the waiting tenant compiles next. So
any number of tenants' runaway schemas leave a new tenant a worker within about PREEMPT_AFTER_S
and a worker's start. A compile waits for a worker at most `timeout_s`; past it, `Busy`.
Workers start on first use, or all at once with `warm()`; `close()` kills them.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import queue
import select
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import msgspec

from gapless.frontend.grammar.worker import HEADER, WorkerInit, write_frame

log = logging.getLogger("gapless.frontend")

MAX_WAITING_PER_WORKER = 8
PREEMPT_AFTER_S = 0.5  # s a compile runs before a tenant with nothing running may stop it
MAX_SERVED_KEPT = 4096  # tenants whose last service time is kept past their last compile
STARTUP_TIMEOUT_S = 60.0  # a worker imports llguidance and builds its tokenizer view
_TIMED_OUT = object()
_WARM = object()


class Busy(Exception):
    """Too many compiles run or wait; retry after retry_s."""

    def __init__(self, message: str, retry_s: int) -> None:
        super().__init__(message)
        self.retry_s = retry_s


class Unavailable(Exception):
    """No worker can compile: it does not start, or the pool is closing."""


class _Slot:
    """One worker process and the thread that talks to it (blocking pipe I/O, off the loop)."""

    def __init__(self, init_frame: bytes, timeout_s: float, memory_mib: int, index: int) -> None:
        self._init_frame = init_frame
        self._timeout_s = timeout_s
        self._memory_mib = memory_mib
        self._name = f"grammar-worker-{index}"
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._proc: subprocess.Popen[bytes] | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # the process, between this slot's thread and close()
        self.closed = False
        self._preempted = False  # the compile in flight was stopped for another tenant
        # time.monotonic() its worker got the grammar in flight (None: idle or starting)
        self.compiling_since: float | None = None

    @property
    def pid(self) -> int | None:
        proc = self._proc
        return proc.pid if proc is not None else None

    def submit(self, grammar: str) -> Future[str]:
        future: Future[str] = Future()
        if self.closed:  # the thread has ended or will at the sentinel: nothing would answer
            future.set_exception(Unavailable("the server is shutting down"))
        else:
            self._put((grammar, future))
        return future

    def warm(self) -> None:
        self._put(_WARM)

    def preempt(self) -> None:
        """Stops the compile in flight (it ends with Busy); the worker is replaced."""
        with self._lock:
            self._preempted = True
            if self._proc is not None:
                _kill(self._proc)

    def close(self) -> None:
        """Kills the worker (a compile in flight ends at once) and ends the thread."""
        self.closed = True
        self._jobs.put(None)
        with self._lock:
            if self._proc is not None:
                _kill(self._proc)

    def _put(self, job: Any) -> None:
        self._jobs.put(job)
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        # why the worker is spawned from this thread: PR_SET_PDEATHSIG fires when the thread
        # that spawned it ends, and this one lives as long as the slot
        while (job := self._jobs.get()) is not None:
            if job is _WARM:
                self._try_spawn()
                continue
            grammar, future = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(self._compile(grammar))
            except Exception as exc:
                future.set_exception(exc)
            if not self.closed:  # a killed worker is replaced before the next compile comes
                self._try_spawn()
        self._discard()
        while not self._jobs.empty():  # what came after the sentinel ends, unanswered no more
            job = self._jobs.get_nowait()
            if isinstance(job, tuple) and job[1].set_running_or_notify_cancel():
                job[1].set_exception(Unavailable("the server is shutting down"))

    def _try_spawn(self) -> None:
        try:
            self._worker()
        except Unavailable as exc:
            log.warning("%s: %s", self._name, exc)

    def _compile(self, grammar: str) -> str:
        with self._lock:
            self._preempted = False
        proc = self._worker()
        assert proc.stdin is not None and proc.stdout is not None
        try:
            write_frame(proc.stdin.fileno(), grammar.encode())
            self.compiling_since = time.monotonic()
        except OSError:
            reply: object = None  # it died between compiles: say so below
        else:
            reply = _read_reply(proc.stdout.fileno(), time.monotonic() + self._timeout_s)
        finally:
            self.compiling_since = None
        if isinstance(reply, bytes):
            return reply.decode()
        status = self._discard()
        if self.closed:
            raise Unavailable("the server is shutting down")
        if self._preempted:
            log.info("%s: a compile stopped for a tenant with none running", self._name)
            raise Busy("grammar compiles are busy: this compile ran long and was stopped for "
                       "another tenant's", max(1, math.ceil(self._timeout_s)))  # fmt: skip
        if reply is _TIMED_OUT:
            log.warning("%s: a compile ran past %g s; worker killed", self._name, self._timeout_s)
            return f"it did not compile within {self._timeout_s:g} s"
        if status == -signal.SIGABRT:  # an allocation past RLIMIT_AS aborts the worker
            log.warning("%s: a compile ran past %d MiB; worker ended", self._name, self._memory_mib)
            return f"compiling it needs more than the {self._memory_mib} MiB a compile may use"
        log.warning("%s: the worker ended during a compile (status %s)", self._name, status)
        return f"the grammar compiler failed on it (status {status})"

    def _worker(self) -> subprocess.Popen[bytes]:
        """The live worker, spawned (and its READY awaited) if there is none."""
        with self._lock:
            if self.closed:
                raise Unavailable("the server is shutting down")
            if self._proc is not None and self._proc.poll() is None:
                return self._proc
            proc = subprocess.Popen(
                [sys.executable, "-m", "gapless.frontend.grammar.worker", str(os.getpid())],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
            )
            self._proc = proc
        assert proc.stdin is not None and proc.stdout is not None
        try:
            write_frame(proc.stdin.fileno(), self._init_frame)
            ready = _read_reply(proc.stdout.fileno(), time.monotonic() + STARTUP_TIMEOUT_S)
        except OSError:
            ready = None
        if ready != b"":
            status = self._discard()
            if self.closed:  # killed while starting
                raise Unavailable("the server is shutting down")
            raise Unavailable(f"the grammar worker did not start (status {status})")
        return proc

    def _discard(self) -> int | None:
        """Kills and reaps the worker; its exit status."""
        with self._lock:
            proc, self._proc = self._proc, None
        if proc is None:
            return None
        _kill(proc)
        status = proc.wait()
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                pipe.close()
        return status


def _kill(proc: subprocess.Popen[bytes]) -> None:
    try:
        proc.kill()
    except ProcessLookupError:
        pass


def _read_reply(fd: int, deadline: float) -> object:
    """One frame's payload; None if the worker ended first, _TIMED_OUT past the deadline."""
    poller = select.poll()
    poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
    data = bytearray()
    while True:
        if len(data) >= HEADER.size:
            (size,) = HEADER.unpack_from(data)
            if len(data) >= HEADER.size + size:
                return bytes(data[HEADER.size : HEADER.size + size])
        left = deadline - time.monotonic()
        if left <= 0 or not poller.poll(math.ceil(left * 1000)):
            return _TIMED_OUT
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            return None
        data += chunk


class GrammarPool:
    """`await pool.compile(grammar, tenant)` -> "" if it compiles, else why not; raises Busy
    past the caps, Unavailable if no worker can run. Used from one event loop."""

    def __init__(self, init: WorkerInit, workers: int, timeout_s: float) -> None:
        frame = msgspec.json.encode(init)
        memory_mib = init.memory_bytes // 2**20
        self.timeout_s = timeout_s
        self.per_tenant = max(1, workers // 2)
        self.max_waiting = MAX_WAITING_PER_WORKER * workers
        self._slots = [_Slot(frame, timeout_s, memory_mib, i) for i in range(workers)]
        self._free = list(self._slots)
        self._running: dict[str, int] = {}  # tenant -> compiles it runs now
        self._held: dict[_Slot, str] = {}  # slot -> the tenant whose compile it runs
        # tenant -> its waiting compiles, oldest first
        self._waiting: dict[str, deque[asyncio.Future[_Slot]]] = {}
        self._num_waiting = 0
        self._served_at: dict[str, float] = {}  # tenant -> when it last got a worker
        self._recheck: asyncio.TimerHandle | None = None
        self.closed = False

    @property
    def worker_pids(self) -> list[int]:
        return [pid for slot in self._slots if (pid := slot.pid) is not None]

    def warm(self) -> None:
        """Spawns every worker now, rather than at its first compile."""
        for slot in self._slots:
            slot.warm()

    def close(self) -> None:
        self.closed = True
        for slot in self._slots:
            slot.close()
        for line in self._waiting.values():
            for waiter in line:
                if not waiter.done():
                    waiter.set_exception(Unavailable("the server is shutting down"))
        self._waiting.clear()
        self._num_waiting = 0
        if self._recheck is not None:
            self._recheck.cancel()

    async def compile(self, grammar: str, tenant: str) -> str:
        slot = await self._acquire(tenant)
        job = slot.submit(grammar)
        try:
            return await asyncio.shield(asyncio.wrap_future(job))
        finally:  # the worker is free once the job ends, even if this request has gone
            if job.done():
                self._release(slot, tenant)
            else:
                done = _on_loop(asyncio.get_running_loop(), self._release, slot, tenant)
                job.add_done_callback(lambda _: done())

    async def _acquire(self, tenant: str) -> _Slot:
        if self.closed:
            raise Unavailable("the server is shutting down")
        waiter: asyncio.Future[_Slot] = asyncio.get_running_loop().create_future()
        self._queue(tenant, waiter)
        self._dispatch()
        try:
            return await asyncio.wait_for(asyncio.shield(waiter), self.timeout_s)
        except BaseException as exc:
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                self._release(waiter.result(), tenant)  # a worker came as this gave up
            elif not waiter.done():
                waiter.cancel()
                self._unqueue(tenant, waiter)
            if isinstance(exc, TimeoutError):
                raise self._busy(
                    f"no grammar worker was free within {self.timeout_s:g} s"
                ) from None
            raise

    def _queue(self, tenant: str, waiter: asyncio.Future[_Slot]) -> None:
        """A place in line for `tenant`, within its share of the places; Busy without one."""
        line = self._waiting.get(tenant)
        mine = len(line) if line else 0
        tenants = len(self._running.keys() | self._waiting.keys() | {tenant})
        share = max(1, self.max_waiting // tenants)
        if mine >= share:
            raise self._busy(f"{mine} of this tenant's compiles wait already")
        if self._num_waiting >= self.max_waiting:
            # full: the tenant waiting most gives its newest place, if it holds more than this
            # one would
            most = max(self._waiting, key=lambda t: len(self._waiting[t]))
            if len(self._waiting[most]) <= mine + 1:
                raise self._busy(f"{self._num_waiting} grammar compiles wait already")
            taken = self._waiting[most].pop()
            self._num_waiting -= 1
            if not taken.done():
                taken.set_exception(self._busy("its place in line went to another tenant"))
        self._waiting.setdefault(tenant, deque()).append(waiter)
        self._num_waiting += 1

    def _unqueue(self, tenant: str, waiter: asyncio.Future[_Slot]) -> None:
        line = self._waiting.get(tenant)
        if line is not None and waiter in line:
            line.remove(waiter)
            self._num_waiting -= 1
            if not line:
                del self._waiting[tenant]

    def _busy(self, why: str) -> Busy:
        return Busy(f"grammar compiles are busy: {why}", max(1, math.ceil(self.timeout_s)))

    def _dispatch(self) -> None:
        """Free workers to waiting tenants under their cap: the fewest running first, then the
        one served least recently; then, if a tenant with nothing running still waits, maybe
        a preemption."""
        while self._free and self._waiting:
            running, served = self._running, self._served_at
            eligible = [t for t in self._waiting if running.get(t, 0) < self.per_tenant]
            if not eligible:
                break
            tenant = min(eligible, key=lambda t: (running.get(t, 0), served.get(t, -math.inf)))
            line = self._waiting[tenant]
            waiter = line.popleft()
            self._num_waiting -= 1
            if not line:
                del self._waiting[tenant]
            if waiter.done():
                continue
            slot = self._free.pop()
            running[tenant] = running.get(tenant, 0) + 1
            served[tenant] = time.monotonic()
            self._held[slot] = tenant
            waiter.set_result(slot)
        if len(self._served_at) > MAX_SERVED_KEPT:  # the tenants neither running nor waiting
            for t in self._served_at.keys() - self._running.keys() - self._waiting.keys():
                del self._served_at[t]
        self._maybe_preempt()

    def _maybe_preempt(self) -> None:
        """A tenant with nothing running waits and no worker is free: stop the longest-running
        compile of a tenant above its fair share of workers, once it has run PREEMPT_AFTER_S
        (until then, look again when the first of them gets there)."""
        if self._free or not any(self._running.get(t, 0) == 0 for t in self._waiting):
            return
        fair = len(self._slots) / len(self._running.keys() | self._waiting.keys())
        over = [slot for slot, tenant in self._held.items() if self._running[tenant] > fair]
        if not over:
            return
        now = time.monotonic()
        # why from the worker's start of the compile: a worker still starting has compiled
        # nothing yet
        started = [(since, slot) for slot in over if (since := slot.compiling_since) is not None]
        if started:
            since, victim = min(started, key=lambda x: x[0])
            if now - since >= PREEMPT_AFTER_S:
                del self._held[victim]  # why: stopped once; it is released when its job ends
                victim.preempt()
                return
            wait = since + PREEMPT_AFTER_S - now
        else:
            wait = PREEMPT_AFTER_S / 4
        if self._recheck is None:
            self._recheck = asyncio.get_running_loop().call_later(wait, self._look_again)

    def _look_again(self) -> None:
        self._recheck = None
        if not self.closed:
            self._dispatch()

    def _release(self, slot: _Slot, tenant: str) -> None:
        left = self._running.get(tenant, 0) - 1
        if left > 0:
            self._running[tenant] = left
        else:
            self._running.pop(tenant, None)
        self._held.pop(slot, None)
        self._free.append(slot)
        self._dispatch()


def _on_loop(
    loop: asyncio.AbstractEventLoop, fn: Callable[..., None], *args: Any
) -> Callable[[], None]:
    """fn(*args) as a callable that any thread may call: it runs on loop (if still open)."""

    def call() -> None:
        try:
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: nothing left to release for
            pass

    return call
