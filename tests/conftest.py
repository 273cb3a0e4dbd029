from __future__ import annotations

from pathlib import Path

import pytest

from core.model_cache import default_model_path


@pytest.fixture(scope="session")
def default_gguf() -> Path:
    """The default SmolLM2 GGUF, fetched into the cache on first use."""
    return default_model_path()
