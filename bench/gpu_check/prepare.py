"""`python -m gapless.bench.gpu_check prepare`: the bundle a stock PyTorch + CUDA host lacks,
written where the package index is reachable, for `run` on a GPU host that has no network.

The bundle (a directory, under MAX_BUNDLE_MB):
- wheels/: manylinux x86_64 wheels, for the host's Python, of gapless's runtime requirements
  and its [cuda] extra (flashinfer-python) that the host does not already satisfy, and their
  own requirements likewise; the host's torch is never replaced;
- gapless-*.whl: the project itself (run installs the working tree it runs in, this one only
  where that cannot be built);
- tokenizer.gguf: the default model's GGUF header without its tensors (its tokenizer, chat
  template and metadata; the weights stay behind);
- manifest.json: what travels and why, what does not and why.

Whether the host has a package comes from HOST_IMAGE (the GPU image's list) or, better, from
`--host-freeze FILE` (`pip freeze` run there). A package travels when the host lacks it, when
its version there fails gapless's requirement or is older than constraints.txt's pin (unless
HOST_KEEPS says why the host's must stay), or, for gapless's own requirements, when its version
there is not known.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from email.parser import Parser
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
MAX_BUNDLE_MB = 40  # 10**6 bytes: what travels beside the source tree (64 MiB in all)
DEFAULT_PYTHON = "3.12"  # the GPU image's (KINDS.md)
# the version the figures and the gpu-marked tests ran with
FLASHINFER = "0.6.0"
GLIBC = (17, 24, 26, 27, 28, 31, 34, 35)  # manylinux_2_N tags a host of glibc >= 2.35 takes
PLATFORMS = ("manylinux1_x86_64", "manylinux2014_x86_64",
             *(f"manylinux_2_{n}_x86_64" for n in GLIBC))  # fmt: skip
# requirements that never travel: the host's torch is its CUDA build, and flashinfer's cuDNN,
# CuTe-DSL, cuda-python and NCCL backends (hundreds of MB) are not what gapless's attention
# imports (its prefill and decode wrappers compile from flashinfer's own sources)
NEVER = {
    "torch": "the host's own CUDA build",
    "triton": "comes with the host's torch",
    "nvidia-cudnn-frontend": "flashinfer's cuDNN backend, not used",
    "nvidia-cutlass-dsl": "flashinfer's CuTe-DSL kernels, not used (hundreds of MB)",
    "cuda-python": "flashinfer's optional bindings, not used",
    "cuda-tile": "flashinfer's optional tile kernels, not used",
    "nccl4py": "flashinfer's communication kernels, not used",
}
# the GPU image's packages (KINDS.md, "Python packages already there"); None: version unknown
HOST_IMAGE: dict[str, str | None] = {
    **dict.fromkeys(
        "accelerate aiohttp anyio attrs certifi charset-normalizer click cloudpickle cmake "
        "einops filelock fsspec h11 hf-xet httpcore httpx idna jinja2 markupsafe mpmath "
        "networkx ninja nvidia-ml-py packaging pillow pip prometheus-client protobuf psutil "
        "pygments pytest pytest-benchmark pytest-timeout pyyaml regex requests rich "
        "setuptools shellingham six sympy tabulate tqdm typer typing-extensions urllib3 "
        "uvloop wheel".split()
    ),
    "huggingface-hub": "1.33.0",
    "numpy": "2.5.2",
    "safetensors": "0.8.0",
    "tokenizers": "0.23.2",
    "torch": "2.11.0",
    "transformers": "5.17.0",
    "triton": "3.6.0",
}
# packages whose host version stays although it is older than the pin, and why
HOST_KEEPS = {
    "huggingface-hub": "transformers on the image requires huggingface-hub<2 (gapless: >=0.24)",
}


@dataclass(frozen=True)
class Decision:
    name: str
    travels: bool
    why: str
    file: str = ""
    version: str = ""
    size: int = 0


def target_env(python: str) -> dict[str, str]:
    """Marker values of the GPU host: CPython `python` on Linux x86_64."""
    return {
        "python_version": python,
        "python_full_version": python + ".0",
        "implementation_name": "cpython",
        "platform_python_implementation": "CPython",
        "sys_platform": "linux",
        "platform_system": "Linux",
        "platform_machine": "x86_64",
        "os_name": "posix",
        "extra": "",
    }


def applies(req: Requirement, env: dict[str, str]) -> bool:
    return req.marker is None or req.marker.evaluate(env)


def read_pins(path: Path) -> dict[str, Version]:
    """name -> pinned version of a constraints file (name==version lines)."""
    pins = {}
    for line in path.read_text().splitlines():
        m = re.fullmatch(r"\s*([A-Za-z0-9_.\-]+)\s*==\s*([^\s;#]+).*", line)
        if m:
            pins[canonicalize_name(m.group(1))] = Version(m.group(2))
    return pins


def read_host(path: Path | None) -> dict[str, str | None]:
    """The host's packages: HOST_IMAGE, or a `pip freeze` / `pip list --format=freeze` file."""
    if path is None:
        return {canonicalize_name(k): v for k, v in HOST_IMAGE.items()}
    host: dict[str, str | None] = {}
    for line in path.read_text().splitlines():
        m = re.fullmatch(r"\s*([A-Za-z0-9_.\-]+)\s*(?:==\s*([^\s;#]+))?.*", line)
        if m and not line.lstrip().startswith(("#", "-")):
            host[canonicalize_name(m.group(1))] = m.group(2)
    return host


def project_requirements(extras: Iterable[str] = ("cuda",), flashinfer: str = FLASHINFER):
    """gapless's runtime requirements and those of `extras` (pyproject.toml), flashinfer-python
    pinned to `flashinfer`."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(r) for r in project["dependencies"]]
    for extra in extras:
        reqs += [Requirement(r) for r in project["optional-dependencies"][extra]]
    out = []
    for r in reqs:
        if canonicalize_name(r.name) == "flashinfer-python":
            assert Version(flashinfer) in r.specifier, f"flashinfer {flashinfer} is not {r}"
            r = Requirement(f"flashinfer-python=={flashinfer}")
        out.append(r)
    return out


def host_keeps(
    req: Requirement,
    host: dict[str, str | None],
    pins: dict[str, Version],
    direct: bool,
) -> str | None:
    """Why the host's own copy of req's package will do; None: a wheel travels."""
    name = canonicalize_name(req.name)
    if name not in host:
        return None
    have = host[name]
    if have is None:
        return None if direct else "on the host (version not known; not gapless's own need)"
    version = Version(have)
    if version not in req.specifier:
        return None
    pin = pins.get(name)
    if pin is not None and version < pin:
        keep = HOST_KEEPS.get(name)
        return f"host {have}, older than the pin {pin}: {keep}" if keep else None
    return f"host {have} meets {req.specifier or 'any version'}"


def travel_reason(req: Requirement, host: dict[str, str | None], pins: dict) -> str:
    name = canonicalize_name(req.name)
    if name not in host:
        return "not on the host"
    if host[name] is None:
        return "on the host at a version not known"
    if Version(host[name]) not in req.specifier:
        return f"host {host[name]} fails {req.specifier}"
    return f"host {host[name]} is older than the pin {pins[name]}"


def pip_download(specs: list[str], dest: Path, python: str, index_args: list[str]) -> list[Path]:
    """Wheels of `specs` (no dependencies) for the target host into dest; the new files."""
    before = set(dest.glob("*.whl"))
    platforms = [a for p in PLATFORMS for a in ("--platform", p)]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--python-version", python, "--implementation", "cp", *platforms,
           "--disable-pip-version-check", "--quiet", "-d", str(dest), *index_args, *specs]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"pip download {' '.join(specs)} failed:\n{done.stderr.strip()}")
    return sorted(set(dest.glob("*.whl")) - before)


def wheel_metadata(path: Path) -> tuple[str, str, list[Requirement]]:
    """(name, version, requirements) of a wheel, from its METADATA."""
    with zipfile.ZipFile(path) as zf:
        meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        msg = Parser().parsestr(zf.read(meta).decode())
    reqs = [Requirement(r) for r in msg.get_all("Requires-Dist") or []]
    return canonicalize_name(msg["Name"]), msg["Version"], reqs


def resolve(
    roots: list[Requirement],
    dest: Path,
    host: dict[str, str | None],
    pins: dict[str, Version],
    python: str = DEFAULT_PYTHON,
    index_args: list[str] | None = None,
) -> list[Decision]:
    """Download into dest the wheels the host lacks, following their requirements; a
    Decision per package met, in the order met."""
    env = target_env(python)
    decided: dict[str, Decision] = {}
    wanted: dict[str, Requirement] = {}
    level = [(r, True) for r in roots if applies(r, env)]
    while level:
        fetch: dict[str, tuple[Requirement, str]] = {}
        for req, direct in level:
            name = canonicalize_name(req.name)
            if name in decided or name in fetch:
                got = decided.get(name)
                if got and got.travels and Version(got.version) not in req.specifier:
                    raise RuntimeError(f"{got.name} {got.version} travels, but {req} is needed")
                continue
            if name in NEVER:
                decided[name] = Decision(name, False, NEVER[name])
                continue
            keep = host_keeps(req, host, pins, direct)
            if keep:
                decided[name] = Decision(name, False, keep)
                continue
            pin = pins.get(name)
            spec = (
                f"{req.name}=={pin}"
                if pin is not None and pin in req.specifier
                else str(Requirement(f"{req.name}{req.specifier}"))
            )
            fetch[name] = (req, spec)
            wanted[name] = req
        level = []
        if not fetch:
            continue
        files = pip_download([s for _, s in fetch.values()], dest, python, index_args or [])
        for path in files:
            name, version, reqs = wheel_metadata(path)
            req = wanted.get(name)
            why = travel_reason(req, host, pins) if req else "a requirement of a travelling wheel"
            decided[name] = Decision(name, True, why, path.name, version, path.stat().st_size)
            level += [(r, False) for r in reqs if applies(r, env)]
        missing = set(fetch) - {canonicalize_name(wheel_metadata(p)[0]) for p in files}
        assert not missing, f"pip downloaded no wheel for {sorted(missing)}"
    return list(decided.values())


def project_wheel(dest: Path, root: Path = ROOT) -> Path:
    """A wheel of gapless built from the working tree (no network, no build isolation); the
    build/ folder setuptools leaves in the tree goes unless it was there before."""
    had_build = (root / "build").exists()
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
               "--no-index", "--disable-pip-version-check", "--quiet", "-w", tmp, str(root)]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"building the gapless wheel failed:\n{done.stderr.strip()}")
        if not had_build:
            shutil.rmtree(root / "build", ignore_errors=True)
        (built,) = Path(tmp).glob("gapless-*.whl")
        return Path(shutil.move(str(built), dest / built.name))


def write_tokenizer_gguf(src: Path, dst: Path) -> Path:
    """dst: src's GGUF header, every metadata key with its own type, and no tensors."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    reader = GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = GGUFWriter(dst, arch)  # writes general.architecture itself
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue  # the header's own counts and version
        sub = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), field.types[0], sub)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    return dst


def bundle_size(out: Path) -> int:
    return sum(p.stat().st_size for p in out.rglob("*") if p.is_file())


def _git_commit(root: Path) -> str | None:
    done = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True,
                          text=True)  # fmt: skip
    return done.stdout.strip() if done.returncode == 0 else None


def prepare(
    out: Path,
    python: str = DEFAULT_PYTHON,
    host_freeze: Path | None = None,
    flashinfer: str = FLASHINFER,
    index_args: list[str] | None = None,
    tokenizer_src: Path | None = None,
    max_mb: float = MAX_BUNDLE_MB,
    pins: dict[str, Version] | None = None,
) -> dict:
    """Write the bundle into `out` (emptied first); its manifest. RuntimeError when it would
    be larger than max_mb."""
    if out.exists():
        shutil.rmtree(out)
    wheels = out / "wheels"
    wheels.mkdir(parents=True)
    pins = {**read_pins(ROOT / "constraints.txt"), **(pins or {})}
    host = read_host(host_freeze)
    roots = project_requirements(flashinfer=flashinfer)
    decisions = resolve(roots, wheels, host, pins, python, index_args)
    own = project_wheel(out)
    if tokenizer_src is None:
        from gapless.common.model_cache import default_model_path

        tokenizer_src = default_model_path()
    tokenizer = write_tokenizer_gguf(tokenizer_src, out / "tokenizer.gguf")
    manifest = {
        "python": python,
        "platforms": list(PLATFORMS),
        "flashinfer": flashinfer,
        "gapless_commit": _git_commit(ROOT),
        "gapless_wheel": own.name,
        "tokenizer": {
            "file": tokenizer.name,
            "from": tokenizer_src.name,
            "bytes": tokenizer.stat().st_size,
        },  # fmt: skip
        "host": "--host-freeze " + str(host_freeze) if host_freeze else "HOST_IMAGE",
        "packages": [asdict(d) for d in decisions],
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    manifest["bytes"] = check_size(out, max_mb)
    return manifest


def check_size(out: Path, max_mb: float = MAX_BUNDLE_MB) -> int:
    """The bundle's bytes; RuntimeError naming its largest files when over max_mb."""
    size = bundle_size(out)
    if size > max_mb * 1e6:
        biggest = sorted(out.rglob("*.*"), key=lambda p: -p.stat().st_size)[:5]
        names = ", ".join(f"{p.name} ({p.stat().st_size / 1e6:.1f} MB)" for p in biggest)
        raise RuntimeError(
            f"the bundle is {size / 1e6:.1f} MB, over {max_mb:g} MB; the largest: {names}"
        )
    return size


def format_manifest(manifest: dict, out: Path) -> str:
    lines = [f"bundle {out}: {manifest['bytes'] / 1e6:.1f} MB (limit {MAX_BUNDLE_MB} MB)"]
    for p in manifest["packages"]:
        what = f"{p['version']:>12} {p['size'] / 1e6:6.2f} MB" if p["travels"] else " " * 22
        lines.append(f"  {'+' if p['travels'] else '-'} {p['name']:<24}{what}  {p['why']}")
    tok = manifest["tokenizer"]
    lines.append(f"  + {tok['file']} ({tok['bytes'] / 1e6:.2f} MB, the header of {tok['from']})")
    lines.append(f"  + {manifest['gapless_wheel']}")
    return "\n".join(lines)


def _pin(text: str) -> tuple[str, Version]:
    name, sep, version = text.partition("==")
    if not sep:
        raise RuntimeError(f"--pin {text!r}: expected NAME==VERSION")
    return canonicalize_name(name), Version(version)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m gapless.bench.gpu_check prepare",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--out", default=str(ROOT / ".gpu-bundle"), help="(default: .gpu-bundle)")
    p.add_argument("--python", default=DEFAULT_PYTHON, help="the host's Python (default: 3.12)")
    p.add_argument("--host-freeze", type=Path, help="`pip freeze` of the host (default: "
                   "the GPU image's package list)")  # fmt: skip
    p.add_argument("--flashinfer", default=FLASHINFER, help=f"(default: {FLASHINFER})")
    p.add_argument("--find-links", help="take wheels from this directory, not the index")
    p.add_argument("--pin", action="append", default=[], metavar="NAME==VERSION",
                   help="travel this version of a package (repeatable)")  # fmt: skip
    args = p.parse_args(argv)
    index = ["--no-index", "--find-links", args.find_links] if args.find_links else []
    out = Path(args.out)
    try:
        pins = dict(_pin(text) for text in args.pin)
        manifest = prepare(out, args.python, args.host_freeze, args.flashinfer, index, pins=pins)
    except RuntimeError as e:
        print(f"prepare: {e}", file=sys.stderr)
        return 1
    print(format_manifest(manifest, out))
    rel = os.path.relpath(out, ROOT)
    print(f"\nOn the GPU host, from the repository root: python3 bench/gpu_check/run.py "
          f"--bundle {rel} --out OUT_DIR")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
