"""Server-sent events from a stream of lines: `data:` fields joined per event."""

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
