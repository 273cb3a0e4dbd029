"""`--model` / `--tokenizer` given as a Hugging Face Hub id (`org/name`): the snapshot in the
local Hub cache, fetched first unless HF_HUB_OFFLINE=1 (huggingface_hub honours it, HF_HOME and
HF_HUB_CACHE). Only what gapless reads is fetched: configs, the tokenizer, safetensors."""

from __future__ import annotations

import re
from pathlib import Path

HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
MODEL_FILES = [
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "*.safetensors",
    "*.safetensors.index.json",
]
TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja"]


def is_hub_id(source: str) -> bool:
    """`org/name`, which is not a path that exists here (a local directory wins) nor a .gguf
    file."""
    if source.endswith(".gguf") or not HUB_ID.fullmatch(source):
        return False
    return not Path(source).expanduser().exists()


def local_path(source: str, *, tokenizer_only: bool = False) -> Path:
    """The directory holding `source`: itself if it is a path, else its Hub snapshot.
    ValueError says what went wrong (not cached while offline, no such repository)."""
    if not is_hub_id(source):
        return Path(source).expanduser()
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    patterns = TOKENIZER_FILES if tokenizer_only else MODEL_FILES
    try:
        return Path(snapshot_download(source, allow_patterns=patterns))
    except LocalEntryNotFoundError as e:
        raise ValueError(
            f"{source} is not in the local Hugging Face cache and the Hub cannot be reached "
            f"(HF_HUB_OFFLINE or no network): {e}"
        ) from None
    except HfHubHTTPError as e:
        raise ValueError(f"{source}: the Hugging Face Hub answered {e}") from None
