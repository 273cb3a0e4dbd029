"""/live is liveness, apart from /health's readiness: 200 while the engine loads (no core has
spoken yet) and while draining, so that a probe never restarts a pod finishing its work; 503
only once the engine is dead."""

from __future__ import annotations

import httpx
import pytest

from gapless.frontend.app import App
from tests.frontend.fake_engine import FakeEngine

pytestmark = pytest.mark.anyio


async def test_live_stays_200_while_loading_and_draining(
    app: App, client: httpx.AsyncClient, engine: FakeEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(engine, "core_silent_s", lambda: 100.0)  # loading: no core heard yet
    assert (await client.get("/health")).status_code == 503
    assert (await client.get("/live")).json()["status"] == "alive"
    monkeypatch.setattr(engine, "core_silent_s", lambda: 0.0)  # loaded
    app.state.admission.draining = True
    assert (await client.get("/health")).json()["status"] == "draining"
    assert (await client.get("/live")).status_code == 200
    engine.die("core crashed")
    r = await client.get("/live")
    assert r.status_code == 503 and r.json() == {"status": "dead", "reason": "core crashed"}
