"""Schemathesis over /openapi.json with every check it has (positive and negative data, the
stateful phase over the links it infers, response schemas, SSE events, auth), against the
real frontend behind uvicorn and an engine double that answers at once. The document must
match the server: no failure, whatever the generated request.

The same run by hand, against any server (`gapless serve ...`):

  SCHEMATHESIS_HOOKS=tests.frontend.schema_hooks schemathesis run URL/openapi.json \\
      --checks all --continue-on-failure --max-examples 40 --seed 1 --workers 1 \\
      --suppress-health-check all -H "Authorization: Bearer KEY"

(the hooks let through only the refusals of rules a schema cannot state, each by name).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gapless.common.messages import (
    EngineStats,
    GetStats,
    GetTimeline,
    PrefixCacheReset,
    ResetPrefixCache,
    Timeline,
    TimelineSummary,
)
from tests.frontend.conftest import served
from tests.frontend.fake_engine import FakeEngine

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
KEY = "fuzz-admin-key"
MAX_EXAMPLES = 5  # per operation and phase; the by-hand run above takes more
MAX_MODEL_LEN = 100_000  # a prompt of generated text fits; the fake engine answers at once
# why: the coverage phase walks every boundary of a body's schema, hundreds of cases for
# /v1/responses (~30 s here), whose fields are the chat route's under other names; its fuzzing
# phase and every response check still run
CONFIG = """
[[operations]]
include-operation-id = "createResponse"
phases.coverage.enabled = false
"""


class LiveEngine(FakeEngine):
    """The fake engine, also answering what /health and /v1/engine/* ask of the core."""

    def core_silent_s(self) -> float:
        return 0.0

    def _receive(self, msg) -> None:
        match msg:
            case GetStats(token=token):
                self.dispatch(EngineStats(token, 0, 0, 10, 10))
            case GetTimeline(token=token):
                self.dispatch(Timeline(token, "sim", True, [], TimelineSummary(0.0, 0.0, 0.0)))
            case ResetPrefixCache(token=token):
                self.dispatch(PrefixCacheReset(token, True))
            case _:
                super()._receive(msg)


def test_the_document_matches_the_server(make_config, hf_tokenizer, tmp_path) -> None:
    config = make_config({"max_model_len": MAX_MODEL_LEN}, admin_api_key=KEY)
    report = tmp_path / "schemathesis.json"
    cli = Path(sys.executable).with_name("schemathesis")
    env = dict(os.environ, SCHEMATHESIS_HOOKS="tests.frontend.schema_hooks", PYTHONPATH=str(ROOT))
    options = (
        f"--checks all --continue-on-failure --max-examples {MAX_EXAMPLES} --seed 1 --workers 1"
        " --suppress-health-check all --generation-database none --request-timeout 30 --no-color"
        f" --report json --report-json-path {report}"
    ).split()
    (tmp_path / "schemathesis.toml").write_text(CONFIG)  # found in the working directory
    with served(config, LiveEngine(hf_tokenizer[0])) as port:
        url = f"http://127.0.0.1:{port}/openapi.json"
        auth = ["-H", f"Authorization: Bearer {KEY}"]
        run = subprocess.run(
            [str(cli), "run", url, *options, *auth],
            cwd=tmp_path,  # why: schemathesis writes its cache under the working directory
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
    summary = json.loads(report.read_text())
    cases = summary["test_cases"]
    print(f"schemathesis: {cases['generated']} cases, {summary['filtered']} refused beyond the "
          f"schema, {cases['unique_failures']} failures")  # fmt: skip
    assert run.returncode == 0 and not summary["failures"] and not summary["errors"], run.stdout
    assert cases["generated"] > 1000
    phases = summary["phases"]
    assert {p: phases[p]["status"] for p in ("coverage", "fuzzing", "stateful")} == dict.fromkeys(
        ("coverage", "fuzzing", "stateful"), "success"
    ), "the stateful phase ran over the links it found"
    assert summary["operations"]["tested"] == summary["operations"]["total"] == 18
