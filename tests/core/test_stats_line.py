"""The core's periodic stats line while it has work."""

from __future__ import annotations

import logging

from gapless.common.messages import SamplingParams
from gapless.core.process import StatsLine
from gapless.gpu_runner.sim.backend import SimBackend
from tests.conftest import sim_config
from tests.engine_harness import Harness


def test_stats_line_while_busy_and_none_when_idle(default_gguf, caplog) -> None:
    caplog.set_level(logging.INFO, logger="gapless.core")
    config = sim_config(default_gguf, max_num_seqs=2, overlap=False)
    h = Harness(config, backend=SimBackend(config))
    stats = StatsLine(h.core, interval_s=1.0)
    p = SamplingParams(max_tokens=4000, ignore_eos=True)
    for i in range(3):
        h.add(f"r{i}", list(range(100, 140)), p)
    result = None
    for _ in range(20):
        out = h.core.step(result)
        result = h.backend.collect(h.backend.launch(out.plans[0])) if out.plans else None
        stats.num_tokens += len(result.token_ids) if result else 0
    stats.maybe_log(stats._at + 2.0)
    (line,) = [r.fields for r in caplog.records if r.getMessage() == "stats"]
    assert line["running"] == 2 and line["waiting"] == 1
    assert 0 < line["kv_used"] < 1 and line["tok_per_s"] > 0 and 0 <= line["idle_pct"] <= 100
    assert line["steps_ahead"] == 1, "overlap off"
    caplog.clear()
    stats.maybe_log(stats._at + 0.5)  # not due yet
    assert not [r for r in caplog.records if r.getMessage() == "stats"]
