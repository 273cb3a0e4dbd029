"""bench host-floor: the floor of each line, its table, and one real point on the sim device."""

from __future__ import annotations

import json

import pytest

from gapless.bench.cli import main
from gapless.bench.host_floor import Point, floor_of, format_floors


def point(step_ms: float | None, idle: float | None, batch: int = 64, overlap: bool = True):
    return Point(batch, overlap, 1.0, step_ms, idle, 0.1, 1.0, batch, 100)


def test_the_floor_is_the_shortest_step_kept_fed_from_the_longest_down():
    line = [point(4.0, 0.0), point(1.0, 0.004), point(2.0, 0.002), point(0.5, 0.03)]
    assert floor_of(line) == 1.0
    # a short step that happened to be kept fed below one that was not does not count
    assert floor_of([*line, point(0.25, 0.0)]) == 1.0
    assert floor_of([point(4.0, 0.2), point(2.0, 0.0)]) is None
    assert floor_of([point(None, None), point(2.0, 0.0)]) == 2.0  # a run without steady steps
    assert floor_of(line, threshold=0.05) == 0.5


def test_floor_table_has_a_cell_per_batch_and_overlap():
    points = [point(2.0, 0.0), point(1.0, 0.5), point(2.0, 0.3, overlap=False)]
    points += [point(8.0, 0.0, batch=256)]
    table = format_floors(points)
    assert "64        2.000    none kept" in table
    assert "256        8.000      not run" in table


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--scales", "1,0"], "each scale must be in (0, 100]"),
        (["--batches", "x"], "want integers"),
        (["--workload", "sharegpt"], "use IN:OUT"),
    ],
)
def test_bad_arguments_are_named(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["host-floor", *argv])
    assert exc.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.slow
def test_one_point_on_the_sim_device(tmp_path, default_gguf, capsys):
    out = tmp_path / "floor.json"
    main(
        [
            "host-floor", "--batches", "4", "--scales", "2", "--overlap", "on",
            "--workload", "16:48", "--model", str(default_gguf), "--no-progress",
            "--output-json", str(out), "--plot-dir", str(tmp_path),
        ]
    )  # fmt: skip
    (p,) = json.loads(out.read_text())["points"]
    assert (p["batch"], p["overlap"], p["scale"], p["completed"]) == (4, True, 2.0, 4)
    # the 1B profile decodes 4 x ~40 tokens of context in ~1 ms; scaled 2x: ~2 ms (sim)
    assert p["step_ms"] == pytest.approx(2.0, rel=0.15)
    assert 0.0 <= p["idle"] <= 1.0 and p["num_steps"] >= 47
    assert (tmp_path / "host_floor.png").stat().st_size > 0
    assert "host floor: shortest steady-decode step" in capsys.readouterr().out
