from __future__ import annotations

import pytest

from gapless.bench.prompts import PromptMaker


@pytest.fixture(scope="session")
def maker(default_gguf) -> PromptMaker:
    """Prompts measured with the default model's tokenizer (SmolLM2's, as the tiny model's)."""
    from gapless.common.model_files import load_tokenizer, resolve_model

    info = resolve_model(str(default_gguf))
    return PromptMaker(load_tokenizer(info), info.add_bos_token)
