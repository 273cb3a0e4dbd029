"""The cpu comparison's arithmetic: which figure is over which, and what it says when a part
was skipped (the runs themselves take minutes: bench/RESULTS.md)."""

from gapless.bench.cpu_compare import _summary, _table


def test_each_figure_is_the_ratio_the_issue_asks_and_a_skipped_part_shows_a_dash():
    results = {
        "gapless 32x128:128": {"output_tok_s": 400.0},
        "gapless 1x128:256": {"decode_tok_s": 90.0},
        "gapless 1x128:256 under 2 hogs": {"decode_tok_s": 30.0},
        "transformers generate bfloat16 32x128:128": {"output_tok_s": 150.0},
        "transformers generate float32 32x128:128": {"output_tok_s": 250.0},
        "batch-32 decode step": {"step_ms": 60.0, "floor_ms": 30.0},
    }
    s = _summary(results)
    assert s["32x128:128 gapless / transformers"] == 400 / 250, "against the faster dtype"
    assert s["one stream under 2 hogs / quiet"] == 30 / 90
    assert s["batch-32 step floor / gapless"] == 0.5
    assert s["one stream gapless / llama-server"] is None, "no llama-server given"
    table = _table(s)
    assert "| 32x128:128 gapless / transformers | 1.60 | >= 2.00 | no |" in table
    assert "| one stream gapless / llama-server | - | >= 1.00 | - |" in table
    assert "| batch-32 step floor / gapless | 0.50 | >= 0.67 | no |" in table
