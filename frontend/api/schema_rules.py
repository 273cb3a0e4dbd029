"""JSON schemas as a client wrote them, before they become grammars: what `strict` refuses,
and the closed objects of forced tool calls.

Both walk a schema's subschemas only where JSON Schema puts them (`properties`, `items`,
`anyOf`, `$defs`, ...); what sits under any other key is data, not a schema. A schema comes in
a body nested at most MAX_JSON_DEPTH deep (json_depth.py), far inside Python's recursion limit;
should one still reach it, RecursionError goes to the caller, which answers 400.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

# the keywords llguidance enforces (its JSON-schema compiler's list)
ENFORCED = frozenset(
    {
        *("anyOf", "oneOf", "allOf", "$ref", "const", "enum", "type"),
        *("items", "additionalItems", "prefixItems", "minItems", "maxItems"),
        *("properties", "additionalProperties", "required"),
        *("minLength", "maxLength", "pattern", "format"),
        *("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"),
    }
)
# keywords that constrain nothing, so strict lets them through; why discriminator: it names
# which oneOf branch applies, and oneOf already holds that constraint
ANNOTATIONS = frozenset(
    {
        *("$schema", "$id", "id", "$anchor", "$defs", "definitions", "$comment"),
        *("title", "description", "default", "examples", "deprecated", "readOnly", "writeOnly"),
        "discriminator",
    }
)
# where subschemas sit: a schema, a list of schemas, a name -> schema map
ONE = ("additionalProperties", "additionalItems", "items")
MANY = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
NAMED = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
# an object schema that holds one of these already says what undeclared properties may be
OPEN_KEYS = frozenset({"additionalProperties", "patternProperties", "unevaluatedProperties"})
Slot = int | str | None


def subschemas(schema: dict[str, Any], at: str) -> Iterator[tuple[str, Slot, str, Any]]:
    """(keyword, place in its value, JSON pointer, subschema) of each schema directly inside
    schema; the place is None for a keyword whose value is the schema, else its index or name."""
    for key in ONE:
        value = schema.get(key)
        if isinstance(value, dict):
            yield key, None, f"{at}/{key}", value
    for key in MANY:
        value = schema.get(key)
        if isinstance(value, list):
            for i, item in enumerate(value):
                yield key, i, f"{at}/{key}/{i}", item
    for key in NAMED:
        value = schema.get(key)
        if isinstance(value, dict):
            for name, item in value.items():
                yield key, name, f"{at}/{key}/{_escape(name)}", item


def strict_problem(schema: Any, at: str = "#") -> str | None:
    """The first keyword the grammar engine would not enforce, as "'x-foo' at #/properties/a";
    None if there is none."""
    if not isinstance(schema, dict):
        return None
    for key in schema:
        if key not in ENFORCED and key not in ANNOTATIONS:
            return f"{key!r} at {at}"
    for _, _, where, sub in subschemas(schema, at):
        if (problem := strict_problem(sub, where)) is not None:
            return problem
    return None


def closed_objects(schema: dict[str, Any]) -> dict[str, Any]:
    """A copy of schema where every object schema that does not say what undeclared
    properties may be takes none (additionalProperties false). Objects composed with allOf
    are left as written: closing a part would refuse the other parts' properties."""
    in_all_of = set(_all_of_refs(schema))
    return _close(schema, "#", in_all_of, closable=True)


def _close(schema: Any, at: str, in_all_of: set[str], closable: bool) -> Any:
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key, place, where, sub in subschemas(schema, at):
        closed = _close(sub, where, in_all_of, closable=key != "allOf")
        if place is None:
            out[key] = closed
            continue
        if out[key] is schema[key]:  # copied once, then filled in
            out[key] = list(schema[key]) if isinstance(place, int) else dict(schema[key])
        out[key][place] = closed
    if (
        closable
        and at not in in_all_of
        and "allOf" not in schema
        and _is_object(schema)
        and not OPEN_KEYS & schema.keys()
    ):
        out["additionalProperties"] = False
    return out


def _is_object(schema: dict[str, Any]) -> bool:
    kind = schema.get("type")
    return (
        kind == "object"
        or (isinstance(kind, list) and "object" in kind)
        or ("properties" in schema)
    )


def _all_of_refs(schema: Any) -> Iterator[str]:
    """The $ref of every allOf part that is a reference (its target is part of an allOf)."""
    if not isinstance(schema, dict):
        return
    for key, _, _, sub in subschemas(schema, "#"):
        if key == "allOf" and isinstance(sub, dict) and isinstance(sub.get("$ref"), str):
            yield sub["$ref"]
        yield from _all_of_refs(sub)


def _escape(name: str) -> str:
    """A name as one JSON pointer token."""
    return name.replace("~", "~0").replace("/", "~1")
