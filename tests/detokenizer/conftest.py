from __future__ import annotations

import pytest
from tokenizers import Tokenizer

from core.model_cache import default_model_path


@pytest.fixture(scope="session")
def tokenizer() -> Tokenizer:
    """SmolLM2's tokenizer (byte-level BPE, EOS <|im_end|> = 2), as transformers rebuilds it."""
    from transformers import AutoTokenizer

    path = default_model_path()
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name).backend_tokenizer
