"""SlowReaderWatch holds against a client only what the kernel keeps unacknowledged for it:
what the transport holds may be waiting on a busy event loop."""

from __future__ import annotations

from gapless.frontend.http.asgi import Responder, SlowReaderWatch

EVENT = 200  # bytes


class FakeConnection:
    def __init__(self) -> None:
        self.held = 0  # bytes the transport holds
        self.queued: int | None = 0  # bytes the kernel holds unacknowledged

    def unsent_bytes(self) -> tuple[int, int | None]:
        return self.held, self.queued


def _watch(timeout_s: float = 5.0, max_events: int = 64, waiting: list[int] | None = None):
    async def send(message: dict) -> None:
        pass

    out = Responder(send)
    connection = FakeConnection()
    behind = (lambda: waiting[0]) if waiting is not None else None
    watch = SlowReaderWatch(out, connection, timeout_s, max_events, behind)  # type: ignore[arg-type]
    return out, connection, watch


def _write(out: Responder, events: int) -> None:
    out.sent_events += events
    out.sent_bytes += events * EVENT


def test_bytes_our_loop_has_not_flushed_are_not_the_clients() -> None:
    """The loop stopped with 64 KiB in the transport and the kernel's queue drained by the
    client: however long the stop, neither rule fires."""
    out, connection, watch = _watch()
    _write(out, 1000)
    connection.held = 64 * 1024
    for now in (0.0, 0.5, 10.0, 60.0):
        assert watch.check(now) is None


def test_a_client_that_takes_bytes_is_never_timed_out() -> None:
    out, connection, watch = _watch(max_events=10**6)
    for tick in range(100):
        _write(out, 10)
        connection.queued = 100 * EVENT  # as much waits each time: it takes what comes
        assert watch.check(tick * 0.5) is None


def test_a_client_that_takes_nothing_is_cut_after_the_timeout() -> None:
    out, connection, watch = _watch(timeout_s=5.0, max_events=10**6)
    _write(out, 100)
    connection.queued = 40 * EVENT  # the rest sits in the client's receive buffer
    assert watch.check(0.0) is None
    _write(out, 50)  # our loop writes more, into the transport: not taken by the client
    connection.held = 50 * EVENT
    assert watch.check(4.0) is None
    slow = watch.check(5.5)
    assert slow is not None and slow.reason == "write_timeout"
    assert slow.error().code == "slow_reader" and "5 s" in slow.error().message


def test_more_events_unread_in_the_kernel_than_the_bound_is_a_cut() -> None:
    out, connection, watch = _watch(max_events=64)
    _write(out, 200)
    connection.held = 100 * EVENT  # not counted: it may wait on our loop
    connection.queued = 64 * EVENT
    assert watch.check(0.0) is None
    connection.queued = 65 * EVENT
    slow = watch.check(0.5)
    assert slow is not None and slow.reason == "buffer"


def test_without_the_kernels_count_the_transports_stands_in() -> None:
    out, connection, watch = _watch(timeout_s=1.0, max_events=64)
    _write(out, 200)
    connection.queued = None
    connection.held = 10 * EVENT
    assert watch.check(0.0) is None
    assert watch.check(1.5).reason == "write_timeout"  # type: ignore[union-attr]
    out, connection, watch = _watch(timeout_s=1.0, max_events=64)
    _write(out, 200)
    connection.queued, connection.held = None, 65 * EVENT
    assert watch.check(0.0).reason == "buffer"  # type: ignore[union-attr]


def test_tokens_behind_a_stuck_client_count_and_behind_a_reading_one_do_not() -> None:
    """What waits for the handler counts once the kernel holds bytes the client does not
    take: its handler waits on the client then, not on the event loop."""
    waiting = [500]
    out, connection, watch = _watch(max_events=64, waiting=waiting)
    _write(out, 100)
    connection.held = 50 * EVENT  # a busy loop has not flushed them: nothing in the kernel
    assert watch.check(0.0) is None
    assert watch.check(0.5) is None
    for tick in range(1, 5):  # the client reads: it takes ten events a look
        _write(out, 10)
        connection.queued = 10 * EVENT if tick == 1 else 5 * EVENT
        assert watch.check(0.5 + tick * 0.5) is None
    # it stops: ten events in the kernel, none taken, five hundred tokens behind them
    slow = watch.check(3.0)
    assert slow is not None and slow.reason == "buffer"
    waiting[0] = 0
    assert _watch(max_events=64, waiting=waiting)[2].check(0.0) is None
