"""The edit workload's prediction with changed lines (`gapless bench edit --change-lines`)."""

from __future__ import annotations

from gapless.bench.edit import change_lines, load_prompts


def test_a_tenth_of_the_lines_change_and_the_rest_stay():
    text = load_prompts()[0]["text"]
    lines = text.split("\n")
    changed = change_lines(text, 0.1, seed=3)
    new = changed.split("\n")
    assert len(new) == len(lines)
    differ = [i for i, (a, b) in enumerate(zip(lines, new, strict=True)) if a != b]
    assert len(differ) == round(0.1 * sum(1 for line in lines if line.strip()))
    assert change_lines(text, 0.1, seed=3) == changed  # the same seed, the same lines
    assert change_lines(text, 0.0, seed=3) == text
