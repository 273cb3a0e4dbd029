"""A role's SIGTERM handler (common/process.py): a second SIGTERM that arrives while the first
is being handled must not stop the process from ending."""

from __future__ import annotations

import signal
import threading

from gapless.common import process


def test_a_second_sigterm_inside_the_first_handler_returns(monkeypatch) -> None:
    """The parent's death signal and a kill can both come: the second interrupts the first
    handler inside Event.set, which holds a lock that is not reentrant. The handler must
    return there, not wait on that lock forever."""
    stop = threading.Event()
    monkeypatch.setattr(process, "_stop", stop)
    monkeypatch.setattr(process, "_term_seen", False)
    nested: list[bool] = []
    notify_all = stop._cond.notify_all

    def second_signal_here() -> None:  # set() holds the event's lock while it notifies
        nested.append(True)
        process._on_term(signal.SIGTERM, None)
        notify_all()

    monkeypatch.setattr(stop._cond, "notify_all", second_signal_here)
    handler = threading.Thread(target=process._on_term, args=(signal.SIGTERM, None), daemon=True)
    handler.start()
    handler.join(10)
    assert nested, "the second signal came inside set()"
    assert not handler.is_alive(), "the handler waited on the event's own lock"
    assert stop.is_set() and process.stop_requested()
