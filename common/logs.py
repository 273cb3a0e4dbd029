"""Logging for every gapless process, configured once at its start from --log-level and
--log-format: `text` (one readable line) or `json` (one object per line, for log shippers).

A record's `fields` (logging's `extra={"fields": {...}}`) become key=value pairs in text and
keys of the object in json: the access line and the stats line carry theirs so.
"""

from __future__ import annotations

import logging
import sys
import time

import msgspec

_encoder = msgspec.json.Encoder()


def _fields(record: logging.LogRecord) -> dict:
    fields = getattr(record, "fields", None)
    return fields if isinstance(fields, dict) else {}


class TextFormatter(logging.Formatter):
    def __init__(self, role: str) -> None:
        super().__init__()
        self.role = role

    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record.created))
        pairs = "".join(f" {k}={v}" for k, v in _fields(record).items())
        line = (
            f"{stamp}.{int(record.msecs):03d} {record.levelname:<7} "
            f"{self.role}[{record.process}] {record.getMessage()}{pairs}"
        )
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class JsonFormatter(logging.Formatter):
    def __init__(self, role: str) -> None:
        super().__init__()
        self.role = role

    def format(self, record: logging.LogRecord) -> str:
        obj = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "role": self.role,
            "pid": record.process,
            "logger": record.name,
            "msg": record.getMessage(),
            **_fields(record),
        }
        if record.exc_info:
            obj["exc"] = self.formatException(record.exc_info)
        return _encoder.encode(obj).decode()


def setup_logging(level: str, fmt: str, role: str) -> None:
    """Replace the root logger's handlers with one to stderr in `fmt` at `level`."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(role) if fmt == "json" else TextFormatter(role))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # uvicorn's own lines go through ours; its access log is replaced by the frontend's
    for name in ("uvicorn", "uvicorn.error"):
        logging.getLogger(name).handlers[:] = []
        logging.getLogger(name).propagate = True
    logging.getLogger("uvicorn.access").disabled = True
