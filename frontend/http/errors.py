"""OpenAI-style error bodies and the exception that carries one out of a handler."""

from __future__ import annotations

import re
from typing import TypeVar

import msgspec

from gapless.frontend.http.json_depth import MAX_JSON_DEPTH, deeper_than

T = TypeVar("T")


class ErrorInfo(msgspec.Struct):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(msgspec.Struct):
    error: ErrorInfo


class ApiError(Exception):
    """A request ends with this HTTP status and OpenAI error body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: list[tuple[bytes, bytes]] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")
        self.headers = headers or []

    def body(self) -> ErrorResponse:
        return ErrorResponse(ErrorInfo(self.message, self.type, self.param, self.code))


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


UNAVAILABLE_RETRY_AFTER_S = (
    5  # a 503's Retry-After; why: a restart or another replica is seconds away
)


def engine_unavailable(reason: str) -> ApiError:
    return ApiError(
        503,
        f"the engine is not available: {reason}",
        code="engine_unavailable",
        headers=[(b"retry-after", str(UNAVAILABLE_RETRY_AFTER_S).encode())],
    )


# msgspec ends a validation message with " - at `$.messages[0].role`"; a missing field is named
# in the message itself ("Object missing required field `role`").
_AT = re.compile(r" - at `\$\.?(?P<path>[^`]*)`$")
_MISSING = re.compile(r"missing required field `(?P<field>[^`]+)`")


def from_decode_error(exc: msgspec.DecodeError) -> ApiError:
    """400 for a body msgspec could not decode; `param` is the offending field's path."""
    text = str(exc)
    if not isinstance(exc, msgspec.ValidationError):
        return bad_request(f"request body is not valid JSON: {text}", code="invalid_json")
    path = None
    at = _AT.search(text)
    if at:
        path = at.group("path") or None
        text = text[: at.start()]
    missing = _MISSING.search(text)
    if missing:
        field = missing.group("field")
        path = f"{path}.{field}" if path else field
    where = f" (at {path})" if path else ""
    return bad_request(f"{text}{where}", param=path)


def too_deep(what: str, param: str | None = None) -> ApiError:
    return bad_request(
        f"{what} nests arrays and objects deeper than {MAX_JSON_DEPTH} levels",
        param=param,
        code="json_too_deep",
    )


def decode_body(decoder: msgspec.json.Decoder[T], raw: bytes) -> T:
    """The request body decoded, or a 400 naming what is wrong with it (never a 500). Its
    nesting is bounded before msgspec reads it (json_depth.py)."""
    if deeper_than(raw):
        raise too_deep("request body")
    try:
        return decoder.decode(raw)
    except msgspec.DecodeError as exc:
        if isinstance(exc, msgspec.ValidationError) and "got `float`" in str(exc):
            whole = _whole_floats_as_ints(raw, decoder.type)
            if whole is not None:
                return whole
        raise from_decode_error(exc) from None
    except UnicodeDecodeError as exc:
        raise bad_request(
            f"request body is not valid UTF-8: byte {exc.start} ({exc.reason})", code="invalid_utf8"
        ) from None
    except RecursionError:  # why still: a stack already deep when decoding starts
        raise too_deep("request body") from None


def _whole_floats_as_ints(raw: bytes, schema: type[T]) -> T | None:
    """The body decoded again with each float that is a whole number (`1.0`) read as an int,
    as JSON Schema's integer is any number without a fraction; None if it still does not fit.
    Only a body that failed on a float comes here."""
    try:
        return msgspec.convert(_whole(msgspec.json.decode(raw)), schema)
    except (msgspec.ValidationError, RecursionError):
        return None


def _whole(value: object) -> object:
    if isinstance(value, float):
        return int(value) if value.is_integer() else value
    if isinstance(value, list):
        return [_whole(v) for v in value]
    if isinstance(value, dict):
        return {k: _whole(v) for k, v in value.items()}
    return value
