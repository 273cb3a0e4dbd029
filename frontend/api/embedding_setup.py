"""How the served checkpoint turns hidden states into embeddings, read from its
sentence-transformers files the way sentence-transformers reads them.

- `modules.json` lists the modules; a `sentence_transformers.models.Pooling` module's folder
  (usually `1_Pooling/`) holds `config.json` with the pooling mode (`pooling_mode_lasttoken`,
  `pooling_mode_mean_tokens`, `pooling_mode_cls_token`), and a `...models.Normalize` module asks
  for L2 normalization.
- Without `modules.json` (a causal checkpoint, a GGUF file): the last token, normalized, as
  Qwen3-Embedding and llama.cpp's `--pooling last` do.
- Matryoshka dimensions (`dimensions` in a request): declared by `matryoshka_dimensions` (a
  list) or `is_matryoshka: true` in `config.json` or `config_sentence_transformers.json`;
  without one, `dimensions` is refused.
"""

from __future__ import annotations

import functools
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

log = logging.getLogger("gapless.frontend")

Pooling = Literal["last", "mean", "cls"]
_MODES: dict[str, Pooling] = {
    "pooling_mode_lasttoken": "last",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
}


@dataclass(frozen=True)
class EmbeddingSetup:
    pooling: Pooling
    normalize: bool
    # None: no Matryoshka declaration; () : any size up to hidden_size; else these sizes
    matryoshka: tuple[int, ...] | None = None
    hidden_size: int = 0  # 0: unknown (a GGUF file)


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _pooling(directory: Path, modules: list[dict[str, Any]]) -> Pooling:
    for module in modules:
        if str(module.get("type", "")).endswith("models.Pooling"):
            cfg = _json(directory / str(module.get("path", "")) / "config.json") or {}
            chosen = [mode for key, mode in _MODES.items() if cfg.get(key)]
            others = [k for k, v in cfg.items() if k.startswith("pooling_mode") and v]
            if len(chosen) == 1 and len(others) == 1:
                return chosen[0]
            log.warning("%s: pooling %s is not supported; pooling the last token",
                        directory, others or "unset")  # fmt: skip
    return "last"


def _matryoshka(configs: list[dict[str, Any]]) -> tuple[int, ...] | None:
    for cfg in configs:
        dims = cfg.get("matryoshka_dimensions")
        if isinstance(dims, list) and dims and all(isinstance(d, int) and d > 0 for d in dims):
            return tuple(sorted(set(dims)))
        if cfg.get("is_matryoshka") is True:
            return ()
    return None


@functools.cache
def embedding_setup(model_path: str) -> EmbeddingSetup:
    """The served model's pooling, normalization and Matryoshka sizes (read once)."""
    directory = Path(model_path)
    if not directory.is_dir():  # a GGUF file: no sentence-transformers files
        return EmbeddingSetup("last", True)
    config = _json(directory / "config.json") or {}
    st_config = _json(directory / "config_sentence_transformers.json") or {}
    hidden = int(config.get("hidden_size") or 0)
    matryoshka = _matryoshka([config, st_config])
    modules = _json(directory / "modules.json")
    if not isinstance(modules, list):
        return EmbeddingSetup("last", True, matryoshka, hidden)
    modules = [m for m in modules if isinstance(m, dict)]
    normalize = any(str(m.get("type", "")).endswith("models.Normalize") for m in modules)
    return EmbeddingSetup(_pooling(directory, modules), normalize, matryoshka, hidden)
