"""Server-sent events from a stream of bytes: `data:` fields joined per event."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Event:
    data: str
    event: str = "message"  # the `event:` field, when the server names one


class SSEDecoder:
    """Feed lines (without their newline); complete events come back as a blank line ends them."""

    def __init__(self) -> None:
        self._data: list[str] = []
        self._event = "message"

    def feed(self, line: str) -> Event | None:
        line = line.rstrip("\r")
        if not line:
            return self.flush()
        if line.startswith(":"):  # comment or keep-alive
            return None
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "data":
            self._data.append(value)
        elif name == "event":
            self._event = value
        return None

    def flush(self) -> Event | None:
        """The event being built, if any; also called when the stream ends without a blank line."""
        if not self._data:
            self._event = "message"
            return None
        event = Event("\n".join(self._data), self._event)
        self._data, self._event = [], "message"
        return event


class SSEStream:
    """Feed a body's bytes as they arrive; the events they complete come back in order.

    The usual event, one `data: ` line and a blank line, is cut from the bytes directly; any
    other (comments, `event:` lines, several data lines) goes line by line through SSEDecoder.
    CRLF line ends become LF first. why: a load generator on the server's cores reads tens of
    thousands of events a second, and reading line by line cost it a coroutine per line.
    """

    def __init__(self) -> None:
        self._rest = b""

    def feed(self, data: bytes) -> list[Event]:
        data = self._rest + data
        if b"\r" in data:
            cut = len(data) - 1 if data.endswith(b"\r") else len(data)  # its \n may come next
            data = data[:cut].replace(b"\r\n", b"\n") + data[cut:]
        blocks = data.split(b"\n\n")
        self._rest = blocks.pop()
        events = []
        for block in blocks:
            if block.startswith(b"data: ") and b"\n" not in block:
                events.append(Event(block[6:].decode()))
                continue
            decoder = SSEDecoder()
            for line in block.decode().split("\n"):
                decoder.feed(line)
            if (event := decoder.flush()) is not None:
                events.append(event)
        return events
