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


def test_turns_taken_side_by_side_count_by_the_median_of_their_ratios():
    """A slow spell that takes one side of a pair takes the medians' ratio with it; the pairs'
    ratios keep the spell to one pair."""
    results = {
        "gapless 1x128:256": {"runs_tok_s": [180.0, 150.0, 160.0]},
        "llama-server 1x128:256": {"runs_tok_s": [160.0, 160.0, 160.0]},
        "batch-32 decode step": {
            "step_ms": 34.0,
            "floor_ms": 21.0,
            "pairs_ms": [[20.0, 34.0], [26.0, 35.0], [20.0, 27.0], [21.0, 27.0], [26.0, 34.0]],
        },
    }
    s = _summary(results)
    assert s["one stream gapless / llama-server"] == 1.0, "ratios 1.125, 0.9375, 1.0"
    assert s["batch-32 step floor / gapless"] == 26 / 35, "ratios .59 .74 .743 .76 .78"
