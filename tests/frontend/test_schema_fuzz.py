"""Schemathesis over /openapi.json of a live `gapless serve --device sim`: no operation answers
a 5xx, whatever the generated request (inside the declared ranges and outside them)."""

from __future__ import annotations

from collections import Counter

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from tests.server import Server

pytestmark = pytest.mark.slow

# per operation and mode; the GETs without parameters stop after a few, and have no negative
POSITIVE, NEGATIVE = 80, 50


def _fuzz(operation, mode: GenerationMode, examples: int, statuses: Counter, failures: list):
    @given(operation.as_strategy(mode))
    @settings(
        max_examples=examples,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        database=None,
    )
    def run(case) -> None:
        response = case.call(timeout=30)
        statuses[(f"{mode.value} {case.method} {case.path}", response.status_code)] += 1
        if response.status_code >= 500:
            failures.append((case.method, case.path, case.body, response.text[:300]))

    run()


def test_no_operation_answers_5xx(default_gguf) -> None:
    # a short context keeps every generated max_tokens quick on the sim device
    server = Server(
        "--model", str(default_gguf), "--device", "sim", "--served-model-name", "sim",
        "--max-model-len", "64", "--max-n", "4",
    )  # fmt: skip
    statuses: Counter[tuple[str, int]] = Counter()
    failures: list[tuple] = []
    try:
        schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
        for result in schema.get_all_operations():
            operation = result.ok()
            _fuzz(operation, GenerationMode.POSITIVE, POSITIVE, statuses, failures)
            if operation.method.upper() == "POST":
                _fuzz(operation, GenerationMode.NEGATIVE, NEGATIVE, statuses, failures)
    finally:
        assert server.stop() == 0, server.read_log()
    print(f"schema fuzz (sim): {sum(statuses.values())} requests: {dict(statuses)}")
    assert sum(statuses.values()) >= 200
    assert not failures, failures[:5]
    assert "Traceback" not in server.read_log(), server.read_log()
