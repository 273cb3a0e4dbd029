"""The nesting bound's measure (frontend/http/json_depth.py): exact against a plain reading of the
bytes, blind to brackets in strings, and linear in the document's size."""

from __future__ import annotations

import json
import random

import pytest

from gapless.frontend.http.json_depth import MAX_JSON_DEPTH, deeper_than, json_depth


def _read_depth(doc: bytes) -> int:
    """The module docstring's rule, one byte at a time."""
    depth = deepest = backslashes = 0
    in_string = False
    for c in doc:
        if c == ord('"') and backslashes % 2 == 0:
            in_string = not in_string
        elif not in_string and c in b"[{":
            depth += 1
            deepest = max(deepest, depth)
        elif not in_string and c in b"]}":
            depth -= 1
        backslashes = backslashes + 1 if c == ord("\\") else 0
    return deepest


def test_depth_equals_the_rule_on_any_bytes() -> None:
    rng = random.Random(38)
    for _ in range(5000):
        doc = bytes(rng.choice(b'[]{}"\\a') for _ in range(rng.randint(0, 40)))
        assert json_depth(doc) == _read_depth(doc), doc


@pytest.mark.parametrize(
    "value, depth",
    [
        ({}, 1),
        ([], 1),
        ({"a": [1, {"b": []}]}, 4),
        ({"a": "[[[{{{"}, 1),
        ({"a": '\\"[[', "b": "\\", "c": [["]]]"]]}, 3),
        ("[" * 1000, 0),
        ([[[[[]]]]], 5),
    ],
)
def test_depth_of_json(value: object, depth: int) -> None:
    for text in (json.dumps(value), json.dumps(value, ensure_ascii=False, indent=1)):
        assert json_depth(text) == json_depth(text.encode()) == depth
        assert not deeper_than(text, depth) and (depth == 0 or deeper_than(text, depth - 1))


def test_the_bound() -> None:
    at = "[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH
    assert not deeper_than(at) and deeper_than("[" + at + "]")
    assert not deeper_than(json.dumps({"prompt": "{" * 100_000}))
    assert not deeper_than("[]" * 100_000)  # many brackets, depth 1


BODIES = {
    # 2M arrays deep, just under the 4 MiB body cap
    "nested": b"[" * 2_000_000 + b"]" * 2_000_000,
    # prose with brackets in its one string, no escapes
    "prose": b'{"prompt": "' + b"a [word] or {two}, " * ((4 << 20) // 19 - 1) + b'"}',
    # brackets and escaped quotes inside one long string
    "in_string": b'{"prompt": "' + b'[\\"{' * ((1 << 20) - 4) + b'"}',
}


@pytest.mark.parametrize("kind", sorted(BODIES))
def test_bench_depth_of_4mib(benchmark, kind: str) -> None:
    body = BODIES[kind]
    assert len(body) <= 4 * 2**20
    assert benchmark(deeper_than, body) == (kind == "nested")
