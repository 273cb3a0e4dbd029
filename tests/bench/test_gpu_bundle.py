"""The GPU check's bundle, offline: which wheels travel and why (resolved from a local folder of
wheels), the size limit, the project's wheel, and the tokenizer-only GGUF, which must load and
tokenize exactly as the whole file does."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import numpy as np
import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from gapless.bench.gpu_check import prepare
from gapless.common.gguf_file import read_gguf
from gapless.common.model_files import load_arch, load_tokenizer, resolve_model

TEXTS = [
    "The capital of France is Paris.",
    "  leading spaces, ünïcödé, emoji 🚀 and\ttabs\nnew lines",
    "<|im_start|>user\nHello<|im_end|>",
    "def f(x):\n    return x ** 2  # code",
]


def fake_wheel(folder: Path, name: str, version: str, requires: list[str] = ()) -> Path:
    """A pure-Python wheel that pip can download from a folder: only its metadata."""
    dist = f"{name.replace('-', '_')}-{version}"
    path = folder / f"{dist}-py3-none-any.whl"
    meta = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"]
    meta += [f"Requires-Dist: {r}" for r in requires]
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"{dist}.dist-info/METADATA", "\n".join(meta) + "\n")
        zf.writestr(f"{dist}.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\n"
                    "Tag: py3-none-any\n")  # fmt: skip
        zf.writestr(f"{dist}.dist-info/RECORD", "")
    return path


@pytest.fixture
def index(tmp_path) -> Path:
    folder = tmp_path / "index"
    folder.mkdir()
    fake_wheel(folder, "alpha", "1.0", ["beta>=1", "torch", "gamma; sys_platform == 'win32'"])
    fake_wheel(folder, "beta", "1.5", ["delta", "epsilon>=1"])
    fake_wheel(folder, "beta", "2.0", ["delta"])
    fake_wheel(folder, "epsilon", "2.0")
    fake_wheel(folder, "epsilon", "3.0")
    fake_wheel(folder, "zeta", "3.0")
    fake_wheel(folder, "eta", "5.0")
    return folder


def test_what_travels_and_why(index, tmp_path, monkeypatch):
    monkeypatch.setitem(prepare.HOST_KEEPS, "eta", "a host package pins it")
    roots = [Requirement(r) for r in ("alpha", "epsilon>=1", "zeta>=2", "eta>=4", "theta")]
    host = {"delta": None, "epsilon": "1.0", "zeta": "3.0", "eta": "4.0", "theta": None,
            "torch": "2.11.0"}  # fmt: skip
    pins = {"beta": Version("1.5"), "epsilon": Version("2.0"), "eta": Version("5.0")}
    dest = tmp_path / "wheels"
    dest.mkdir()
    index_args = ["--no-index", "--find-links", str(index)]
    with pytest.raises(RuntimeError, match="theta"):  # gapless's own need of unknown version
        prepare.resolve(roots, dest, host, pins, index_args=index_args)
    decided = {
        d.name: d
        for d in prepare.resolve(roots[:4], tmp_path / "w2", host, pins, index_args=index_args)
    }
    assert decided["alpha"].travels and decided["alpha"].why == "not on the host"
    assert decided["beta"].travels and decided["beta"].version == "1.5"  # the pin
    assert decided["epsilon"].travels and decided["epsilon"].version == "2.0"
    assert decided["epsilon"].why == "host 1.0 is older than the pin 2.0"
    assert not decided["zeta"].travels and "host 3.0 meets" in decided["zeta"].why
    assert not decided["eta"].travels and "a host package pins it" in decided["eta"].why
    assert not decided["delta"].travels and "not gapless's own need" in decided["delta"].why
    assert not decided["torch"].travels and "CUDA build" in decided["torch"].why
    assert "gamma" not in decided  # its marker: windows only
    assert sorted(p.name for p in (tmp_path / "w2").glob("*.whl")) == [
        "alpha-1.0-py3-none-any.whl", "beta-1.5-py3-none-any.whl",
        "epsilon-2.0-py3-none-any.whl",
    ]  # fmt: skip


def test_the_host_list_and_a_freeze_file(tmp_path):
    image = prepare.read_host(None)
    assert image["tokenizers"] == "0.23.2" and image["jinja2"] is None and "msgspec" not in image
    freeze = tmp_path / "freeze.txt"
    freeze.write_text("# pip freeze\nNumPy==2.5.2\nmsgspec==0.22.0\n-e git+x#egg=y\nrich\n")
    assert prepare.read_host(freeze) == {"numpy": "2.5.2", "msgspec": "0.22.0", "rich": None}
    pins = prepare.read_pins(prepare.ROOT / "constraints.txt")
    assert pins["tokenizers"] > Version("0.23.2")  # so the image's travels again


def test_the_project_requirements_pin_the_tested_flashinfer():
    roots = {r.name: r for r in prepare.project_requirements()}
    assert str(roots["flashinfer-python"].specifier) == f"=={prepare.FLASHINFER}"
    assert {"msgspec", "pyzmq", "tokenizers", "llguidance", "torch"} <= set(roots)


def test_an_oversized_bundle_names_its_largest_files(tmp_path):
    (tmp_path / "wheels").mkdir()
    (tmp_path / "wheels" / "big-1.0-py3-none-any.whl").write_bytes(b"x" * 300_000)
    (tmp_path / "tokenizer.gguf").write_bytes(b"x" * 100_000)
    assert prepare.check_size(tmp_path, max_mb=1) == 400_000
    with pytest.raises(RuntimeError, match=r"0\.4 MB, over 0\.3 MB.*big-1\.0"):
        prepare.check_size(tmp_path, max_mb=0.3)


@pytest.fixture(scope="module")
def tokenizer_gguf(tmp_path_factory, default_gguf) -> Path:
    return prepare.write_tokenizer_gguf(
        default_gguf, tmp_path_factory.mktemp("bundle") / "tokenizer.gguf"
    )


def test_the_tokenizer_gguf_is_the_header_without_tensors(tokenizer_gguf, default_gguf):
    assert tokenizer_gguf.stat().st_size < 2.5e6 < default_gguf.stat().st_size
    small, full = read_gguf(tokenizer_gguf), read_gguf(default_gguf)
    assert small.tensors == {} and full.tensors
    assert small.metadata.keys() == full.metadata.keys()
    for key, value in full.metadata.items():
        if isinstance(value, np.ndarray):
            assert small.metadata[key].dtype == value.dtype
            assert np.array_equal(small.metadata[key], value), key
        else:
            assert small.metadata[key] == value and type(small.metadata[key]) is type(value), key


def test_the_tokenizer_gguf_tokenizes_as_the_whole_file(tokenizer_gguf, default_gguf):
    small, full = resolve_model(str(tokenizer_gguf)), resolve_model(str(default_gguf))
    assert json.loads(_info(small)) == json.loads(_info(full))
    assert load_arch(small) == load_arch(full)
    a, b = load_tokenizer(small), load_tokenizer(full)
    assert a.get_vocab(True) == b.get_vocab(True)
    for text in TEXTS:
        assert a.encode(text).ids == b.encode(text).ids
        assert a.decode(a.encode(text).ids) == b.decode(b.encode(text).ids)


def _info(info) -> str:
    import msgspec

    return msgspec.json.encode(msgspec.structs.replace(info, path="")).decode()


def test_the_project_wheel_holds_the_packages_and_not_the_tests(tmp_path):
    built = prepare.project_wheel(tmp_path)
    names = zipfile.ZipFile(built).namelist()
    for module in ("gapless/bench/gpu_check/run.py", "gapless/gpu_runner/cuda/startup.py",
                   "gapless/gpu_runner/cpu/paged_decode.cpp", "gapless/launch/cli.py"):  # fmt: skip
        assert module in names
    assert not any(n.startswith("tests/") for n in names)
    assert not (prepare.ROOT / "build").exists()
