"""Schemathesis hooks for the fuzz run of /openapi.json (SCHEMATHESIS_HOOKS=tests.frontend.schema_hooks).

The document states every rule a JSON Schema can state. A few rules of the server depend on
more than a body's shape (frontend/api/openapi.py lists them); a schema-valid body that breaks one
is refused with a 400 whose error names the rule. Only those refusals are not failures here:
each is matched by its error's param (or code) and the start of its message, so any other
refusal of a schema-valid body still fails the run.
"""

from __future__ import annotations

import json

import schemathesis

# (error param, message start), or (None, error code)
BEYOND_THE_SCHEMA = [
    (None, "context_length_exceeded"),  # the prompt's tokens are known once tokenized
    ("min_tokens", "min_tokens ("),  # at most the output budget (a default one included)
    ("tools", "tools hold two functions with the same name"),
    ("tool_choice.function.name", "tool_choice names "),  # one of the tools given
    ("continue_final_message", "continue_final_message needs a last message with text"),
    ("continue_final_message", "the chat template does not render the last message"),
]


def beyond_the_schema(status: int, body: bytes) -> bool:
    """Whether a response refuses a request for one of the rules a schema cannot state."""
    if status != 400:
        return False
    try:
        error = json.loads(body)["error"]
    except (ValueError, KeyError, TypeError):
        return False
    param, code, message = error.get("param"), error.get("code"), error.get("message", "")
    for rule_param, start in BEYOND_THE_SCHEMA:
        if rule_param is None and code == start:
            return True
        if rule_param is not None and param == rule_param and message.startswith(start):
            return True
    return False


@schemathesis.hook
def filter_failure(context, failure, case, response) -> bool:
    """Keep every failure but a schema-valid request refused for a rule beyond the schema."""
    if failure.code != "ST202":  # positive_data_acceptance: schema-valid data refused
        return True
    return not beyond_the_schema(response.status_code, response.content)
