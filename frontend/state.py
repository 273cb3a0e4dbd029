"""What every route handler shares in one frontend process."""

from __future__ import annotations

from dataclasses import dataclass

from core.config import EngineConfig
from frontend.engine_client import EngineClient
from frontend.prompts import Prompter


@dataclass(frozen=True)
class FrontendState:
    config: EngineConfig
    engine: EngineClient
    prompter: Prompter
