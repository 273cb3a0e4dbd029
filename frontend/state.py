"""What every route handler shares in one frontend process."""

from __future__ import annotations

from dataclasses import dataclass

from gapless.common.config import EngineConfig
from gapless.frontend.admission import Admission
from gapless.frontend.engine_client import EngineClient
from gapless.frontend.prompts import Prompter


@dataclass(frozen=True)
class FrontendState:
    config: EngineConfig
    engine: EngineClient
    prompter: Prompter
    admission: Admission
