from __future__ import annotations

import json
import subprocess
import sys

import pytest

from gapless.bench.sse_ceiling import StreamResult, main, summarize

FLOOD = {"sent": {"a": 3, "b": 3}, "cpu": 0.5, "num_late_steps": 0}


def _stream(tokens: list[int], events: int, first: float, last: float) -> StreamResult:
    return StreamResult(tokens=tokens, num_events=events, first_s=first, last_s=last)


def test_summary_counts_tokens_and_events_over_the_window() -> None:
    run = summarize(1, 2, 3, 1.0, [_stream([0, 1, 2], 2, 10.0, 10.5), _stream([0, 1, 2], 3, 10.1, 11.0)], FLOOD, 0.5, 0.25)  # fmt: skip
    assert run.tokens_sent == run.tokens_received == 6 and run.in_order and run.failed == 0
    assert run.window_s == pytest.approx(1.0)
    assert run.tokens_per_s == pytest.approx(6.0) and run.events_per_s == pytest.approx(5.0)
    assert run.tokens_per_event == pytest.approx(1.2)
    assert run.frontend_cpu == pytest.approx(0.5) and run.client_cpu == pytest.approx(0.25)


@pytest.mark.parametrize("tokens", [[0, 2, 1], [0, 1], [0, 1, 1], [1, 2, 3]])
def test_a_lost_or_reordered_token_is_seen(tokens: list[int]) -> None:
    run = summarize(1, 2, 3, 1.0, [_stream([0, 1, 2], 3, 0.0, 1.0), _stream(tokens, 3, 0.0, 1.0)], FLOOD, 0, 0)  # fmt: skip
    assert not run.in_order or run.failed


@pytest.mark.parametrize(
    ("argv", "message"),
    [(["--streams", "0"], "--streams"), (["--api-servers", "1,x"], "--api-servers")],
)
def test_bad_arguments_are_named(argv, message, capsys) -> None:
    with pytest.raises(SystemExit):
        main(argv)
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_a_short_run_delivers_every_token_in_order(tmp_path, default_gguf) -> None:
    # why a process: a run supervises its frontends, which points this process's metrics at
    # the run's directory
    out = tmp_path / "sse.json"
    argv = ["--streams", "16", "--output-len", "200", "--api-servers", "1,2", "--output-json", str(out)]  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-c", "from gapless.bench.cli import main; main()", "sse-ceiling", *argv],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    table = done.stdout
    result = json.loads(out.read_text())
    assert [r["api_servers"] for r in result["runs"]] == [1, 2]
    for run in result["runs"]:
        assert run["tokens_sent"] == run["tokens_received"] == 16 * 200, run
        assert run["in_order"] and run["failed"] == 0 and not run["errors"], run
        assert 16 <= run["num_events"] <= run["tokens_received"]
        assert run["tokens_per_s"] > 0 and run["window_s"] > 0
        row = f"{run['api_servers']:>11} {run['tokens_per_s']:>10,.0f}"
        assert row in table
