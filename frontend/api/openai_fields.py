"""What gapless does with each field of the OpenAI request types it does not decode itself.

One place for the list, made against the request types of the pinned `openai` package
(`openai.types.chat.completion_create_params` and `openai.types.completion_create_params`;
a test checks that every field there is decoded, listed as harmless, or refused here):

- refused: a value that would change the output and that gapless cannot honour is a 400
  naming the field (a null, or the value that means "off", is accepted);
- harmless: accepted and ignored, because honouring it changes nothing the client sees;
- anything else outside the API is ignored, with a debug log naming it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import msgspec

from gapless.frontend.http.errors import bad_request

log = logging.getLogger("gapless.frontend")

# accepted, and honouring them changes nothing a client sees
HARMLESS = frozenset(
    {
        "store",
        "metadata",
        "service_tier",
        "prompt_cache_key",
        "prompt_cache_options",
        "prompt_cache_retention",
        "safety_identifier",
        "max_tool_calls",  # responses: counts built-in tool calls, and there are none
    }
)

# field -> (value, whole body) -> why it is refused, or None when this value is fine
Rule = Callable[[Any, dict[str, Any]], str | None]


def _set(what: str) -> Rule:
    """Refused whenever it is given a value other than null."""
    return lambda value, body: None if value is None else what


def _modalities(value: Any, body: dict[str, Any]) -> str | None:
    if value is None or value == ["text"] or value == []:
        return None
    return f"only the text modality is supported, got {value!r}"


def _best_of(value: Any, body: dict[str, Any]) -> str | None:
    n = body.get("n") or 1
    if value is None or value == n:
        return None
    return f"best_of ({value}) other than n ({n}) is not supported: choices are not ranked"


def _suffix(value: Any, body: dict[str, Any]) -> str | None:
    return None if not value else "a suffix (fill-in-the-middle) is not supported"


CHAT_REFUSED: dict[str, Rule] = {
    "audio": _set("audio output is not supported"),
    "modalities": _modalities,
    "functions": _set("the legacy `functions` field is not supported; use `tools`"),
    "function_call": _set("the legacy `function_call` field is not supported; use `tool_choice`"),
    "moderation": _set("moderation is not supported"),
    "reasoning_effort": _set("the served model does not take a reasoning effort"),
    "verbosity": _set("verbosity is not supported"),
    "web_search_options": _set("web search is not supported"),
}


def _true(what: str) -> Rule:
    """Refused when true."""
    return lambda value, body: what if value else None


RESPONSES_REFUSED: dict[str, Rule] = {
    "access_programs": _set("access programs are not supported"),
    "background": _true("background responses are not supported"),
    "background_options": _set("background responses are not supported"),
    "context_management": _set("context management (compaction) is not supported"),
    "conversation": _set("conversations are not supported; use previous_response_id"),
    "image": _set("image generation is not supported"),
    "moderation": _set("moderation is not supported"),
    "prompt": _set("stored prompt templates are not supported"),
}

COMPLETION_REFUSED: dict[str, Rule] = {
    "best_of": _best_of,
    "suffix": _suffix,
}

_raw_decoder = msgspec.json.Decoder(dict[str, msgspec.Raw])


def check_fields(
    raw: bytes, endpoint: str, known: frozenset[str], refused: dict[str, Rule]
) -> None:
    """400 naming the first refused field with a value gapless cannot honour; a debug log for
    fields outside the API. `known` is what the endpoint's schema decodes. Call after the body
    decoded into its schema, so `raw` is a JSON object."""
    fields = _raw_decoder.decode(raw)
    extra = fields.keys() - known - HARMLESS
    if not extra:
        return
    present = {k: msgspec.json.decode(fields[k]) for k in extra & refused.keys()}
    for name, value in present.items():
        why = refused[name](value, {**present, "n": _n(fields)})
        if why is not None:
            raise bad_request(f"{name}: {why}", param=name, code="unsupported_field")
    unknown = extra - refused.keys()
    if unknown and log.isEnabledFor(logging.DEBUG):
        log.debug("%s: ignoring fields outside the API: %s", endpoint, ", ".join(sorted(unknown)))


def _n(fields: dict[str, msgspec.Raw]) -> int | None:
    raw = fields.get("n")
    return None if raw is None else msgspec.json.decode(raw)


def struct_fields(schema: type[msgspec.Struct]) -> frozenset[str]:
    return frozenset(schema.__struct_fields__)
