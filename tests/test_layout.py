"""The installed layout and its layering.

Folders are the architecture: `common/` (what every process shares: messages, config, channels,
metrics, model files) and `shm/` at the bottom; the four process roles (`frontend/`, `core/`,
`detokenizer/`, `gpu_runner/`) above them; `launch/` (the CLI and supervisor, which starts every
role) and `bench/` (which drives a server from outside) on top. Every module installs under the
one `gapless` namespace, and nothing bare lands in site-packages.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = ("common", "shm")
ROLES = ("frontend", "core", "detokenizer", "gpu_runner")
TOP = ("launch", "bench")
PACKAGES = (*SHARED, *ROLES, *TOP)

OUTSIDE = """
import importlib.util, sys
import gapless.core.scheduler, gapless.launch.cli, gapless.bench.cli, gapless.shm, gapless.common
import gapless.gpu_runner.cpu.kernels, gapless.gpu_runner.sim.backend
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


def test_every_package_folder_is_installed():
    """pyproject's explicit package list holds every folder with an __init__.py."""
    text = (ROOT / "pyproject.toml").read_text()
    block = re.search(r"^packages = \[(.*?)\]", text, re.M | re.S)
    assert block, "pyproject.toml lists its packages"
    listed = set(re.findall(r'"([\w.]+)"', block.group(1)))
    on_disk = {
        "gapless." + ".".join(init.parent.relative_to(ROOT).parts)
        for pkg in PACKAGES
        for init in (ROOT / pkg).rglob("__init__.py")
    }
    assert len(on_disk) > 10 and on_disk == listed


def _project_imports(path: Path) -> list[str]:
    """The project modules a file imports (`gapless.x.y`), at any depth in it."""
    tree = ast.parse(path.read_text(), str(path))
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module == "gapless":  # a package
            names += [f"gapless.{a.name}" for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return [n for n in names if n.split(".")[0] in (*PACKAGES, "gapless")]


def _package_of(module: str) -> str:
    return module.split(".")[1] if module.startswith("gapless.") else module.split(".")[0]


def _imports_of(packages: tuple[str, ...]) -> list[tuple[str, str, str]]:
    """(file, its package, the package it imports) for every project import in packages."""
    return [
        (str(f.relative_to(ROOT)), pkg, _package_of(n))
        for pkg in packages
        for f in (ROOT / pkg).rglob("*.py")
        for n in _project_imports(f)
    ]


def test_every_import_names_the_namespace():
    files = [p for pkg in (*PACKAGES, "tests") for p in (ROOT / pkg).rglob("*.py")]
    bare = [
        f"{f.relative_to(ROOT)}: {n}"
        for f in files
        for n in _project_imports(f)
        if not n.startswith("gapless")
    ]
    assert len(files) > 80 and bare == []


def test_the_layers():
    """Shared modules import only shared ones; a role imports the shared layer and itself,
    never another role; nothing but the top imports launch or bench, and the serving path
    (launch) does not import bench."""
    found = _imports_of(PACKAGES)
    assert len(found) > 200, "the imports were read"
    allowed = {
        **{pkg: set(SHARED) for pkg in SHARED},
        **{pkg: {*SHARED, pkg} for pkg in ROLES},
        "launch": {*SHARED, *ROLES, "launch"},
        "bench": set(PACKAGES),
    }
    wrong = [f"{f} imports gapless.{to}" for f, pkg, to in found if to not in allowed[pkg]]
    assert wrong == []


# the frontend's rooms (frontend/__init__.py): room -> the rooms it may import, itself included
FRONTEND_ROOMS = {
    "http": {"http"},
    "engine": {"engine", "http"},
    "grammar": {"grammar"},  # its worker is a process of its own
    "api": {"api", "engine", "grammar", "http"},
}
FRONTEND_TOP = ["__init__.py", "app.py", "server.py"]  # on top of the rooms


def test_the_frontend_rooms():
    """Every frontend module sits in a room but the router and the process entry; a room
    imports only the rooms below it, and none imports the top."""
    frontend = ROOT / "frontend"
    assert sorted(p.name for p in frontend.glob("*.py")) == FRONTEND_TOP
    assert {p.name for p in frontend.iterdir() if p.is_dir() and p.name != "__pycache__"} == set(
        FRONTEND_ROOMS
    )
    wrong, seen = [], 0
    for room, allowed in FRONTEND_ROOMS.items():
        for f in (frontend / room).rglob("*.py"):
            for name in _project_imports(f):
                parts = name.split(".")
                if parts[:2] != ["gapless", "frontend"]:
                    continue
                seen += 1
                if len(parts) < 3 or parts[2] not in allowed:
                    wrong.append(f"{f.relative_to(ROOT)} imports {name}")
    assert seen > 50, "the imports were read"
    assert wrong == []
