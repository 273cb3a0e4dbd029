"""Nothing that crosses a process boundary is pickled: no package module uses pickle, pyzmq's
pyobj helpers or multiprocessing (which pickles what it starts)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("common", "launch", "core", "frontend", "detokenizer", "gpu_runner", "shm", "bench")
BANNED_MODULES = {"pickle", "cPickle", "dill", "cloudpickle", "multiprocessing"}
BANNED_CALLS = {"send_pyobj", "recv_pyobj", "load", "loads"}


def _offences(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names if a.name.split(".")[0] in BANNED_MODULES]
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module.split(".")[0] in BANNED_MODULES:
                out.append(node.module)
        elif isinstance(node, ast.Attribute) and node.attr in {"send_pyobj", "recv_pyobj"}:
            out.append(node.attr)
        elif (
            isinstance(node, ast.Attribute)
            and node.attr in BANNED_CALLS
            and isinstance(node.value, ast.Name)
            and node.value.id == "torch"
        ):
            out.append(f"torch.{node.attr}")
    return [f"{path}: {o}" for o in out]


def test_no_pickle_in_any_package():
    files = [p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")]
    assert len(files) > 40, "the packages were found"
    offences = [o for f in files for o in _offences(f)]
    assert offences == []


def test_the_check_catches_pickle(tmp_path):
    bad = tmp_path / "probe.py"
    bad.write_text("import pickle\nimport torch\nx = torch.load('w')\n")
    assert len(_offences(bad)) == 2
