"""What every route handler shares in one frontend process."""

from __future__ import annotations

from dataclasses import dataclass

from gapless.common.config import EngineConfig
from gapless.frontend.api.prompts import Prompter
from gapless.frontend.api.responses_store import ResponseStore
from gapless.frontend.engine.admission import Admission
from gapless.frontend.engine.client import EngineClient


@dataclass(frozen=True)
class FrontendState:
    config: EngineConfig
    engine: EngineClient
    prompter: Prompter
    admission: Admission
    responses: ResponseStore | None = None  # stored responses; None: kept nowhere
