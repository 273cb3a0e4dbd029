from __future__ import annotations

import pytest
import tokenizers
from tokenizers import Tokenizer

from gapless.common.model_cache import default_model_path


@pytest.fixture(scope="session")
def tokenizer(request: pytest.FixtureRequest) -> Tokenizer:
    """SmolLM2's tokenizer (byte-level BPE, EOS <|im_end|> = 2), as transformers rebuilds it
    from the GGUF. The rebuild takes 10-25 s here, so its JSON is kept in pytest's cache."""
    import transformers

    cache = getattr(request.config, "cache", None)  # None under -p no:cacheprovider
    versions = f"{transformers.__version__}-{tokenizers.__version__}"
    name = f"smollm2-tokenizer-{versions}.json"
    cached = cache.mkdir("detokenizer") / name if cache is not None else None
    if cached is not None and cached.exists():
        return Tokenizer.from_file(str(cached))
    path = default_model_path()
    auto = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tokenizer = auto.backend_tokenizer
    if cached is not None:
        tokenizer.save(str(cached))
    return tokenizer
