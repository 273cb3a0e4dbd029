"""The installed layout: one `gapless` namespace, no bare top-level names, and shared modules
that import no role's module."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("core", "frontend", "detokenizer", "gpu_runner", "shm", "bench")
# what a shared module may import from the project: other shared modules and the shm rings
SHARED = ("gapless.core.common", "gapless.shm")

OUTSIDE = """
import importlib.util, sys
import gapless.core.scheduler, gapless.core.launch.cli, gapless.bench.cli, gapless.shm
assert gapless.core.scheduler.Scheduler
bare = [n for n in %r if importlib.util.find_spec(n) is not None]
print("bare:", bare)
sys.exit(1 if bare else 0)
"""


def test_installed_under_one_namespace_from_outside_the_checkout(tmp_path):
    out = subprocess.run(
        [sys.executable, "-c", OUTSIDE % (PACKAGES,)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "bare: []" in out.stdout


def _project_imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return [n for n in names if n.split(".")[0] in (*PACKAGES, "gapless")]


def test_every_import_names_the_namespace():
    files = [p for pkg in (*PACKAGES, "tests") for p in (ROOT / pkg).rglob("*.py")]
    bare = [
        f"{f.relative_to(ROOT)}: {n}"
        for f in files
        for n in _project_imports(f)
        if not n.startswith("gapless")
    ]
    assert len(files) > 80 and bare == []


def test_shared_modules_import_no_role():
    files = [*(ROOT / "core" / "common").glob("*.py"), *(ROOT / "shm").glob("*.py")]
    assert len(files) >= 8, "the shared modules were found"
    inversions = [
        f"{f.relative_to(ROOT)} imports {n}"
        for f in files
        for n in _project_imports(f)
        if not n.startswith(SHARED)
    ]
    assert inversions == []
