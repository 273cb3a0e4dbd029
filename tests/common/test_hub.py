"""--model / --tokenizer as a Hugging Face Hub id, read from a cache laid out as the Hub's
(the Hub cannot be reached from here), and generation_config.json's sampling defaults."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from gapless.common.model_files import resolve_model
from gapless.frontend.api.params import sampling_params
from gapless.frontend.api.protocol import CompletionRequest

ROOT = Path(__file__).resolve().parents[2]
GENERATION = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "do_sample": True, "eos_token_id": 2}


def _hub_cache(cache: Path, repo: str, source: Path) -> Path:
    """`source`'s files as the Hub's cache holds them: blobs by hash, a snapshot of symlinks
    named by the commit, refs/main pointing at it."""
    root = cache / ("models--" + repo.replace("/", "--"))
    commit = hashlib.sha1(repo.encode()).hexdigest()
    snapshot = root / "snapshots" / commit
    (root / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for f in source.iterdir():
        data = f.read_bytes()
        blob = root / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / f.name).symlink_to(os.path.relpath(blob, snapshot))
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(commit)
    return snapshot


def _resolve_offline(cache: Path, model: str, tokenizer: str | None = None) -> dict:
    """resolve_model in a process with HF_HUB_OFFLINE=1 and this cache (huggingface_hub reads
    them when imported)."""
    code = (
        "import sys, msgspec; from gapless.common.model_files import resolve_model; "
        "sys.stdout.write(msgspec.json.encode(resolve_model(sys.argv[1], None, "
        "sys.argv[2] or None)).decode())"
    )
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(cache), HF_HOME=str(cache))
    run = subprocess.run(
        [sys.executable, "-c", code, model, tokenizer or ""],
        cwd=ROOT, env=env, capture_output=True, text=True,
    )  # fmt: skip
    if run.returncode:
        raise ValueError(run.stderr.strip().splitlines()[-1])
    return json.loads(run.stdout)


@pytest.fixture
def model_with_generation_config(tiny_model_dir: Path, tmp_path: Path) -> Path:
    out = tmp_path / "model"
    shutil.copytree(tiny_model_dir, out)
    (out / "generation_config.json").write_text(json.dumps(GENERATION))
    return out


def test_model_from_the_hub_cache_offline(model_with_generation_config: Path, tmp_path) -> None:
    cache = tmp_path / "hub"
    snapshot = _hub_cache(cache, "acme/tiny-llama", model_with_generation_config)
    info = _resolve_offline(cache, "acme/tiny-llama")
    assert info["path"] == str(snapshot) and info["architecture"] == "llama"
    assert info["sampling_defaults"] == {"temperature": 0.6, "top_p": 0.9, "top_k": 20.0}
    with pytest.raises(ValueError, match="not in the local Hugging Face cache"):
        _resolve_offline(cache, "acme/not-cached")


def test_tokenizer_from_the_hub_cache(default_gguf: Path, tiny_model_dir: Path, tmp_path) -> None:
    cache = tmp_path / "hub"
    tok = tmp_path / "tok"
    tok.mkdir()
    shutil.copy(tiny_model_dir / "tokenizer.json", tok)
    (tok / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "chat_template": "{{ messages[0]['content'] }}",
                "add_bos_token": True,
                "bos_token": "<|im_start|>",
            }
        )  # fmt: skip
    )
    snapshot = _hub_cache(cache, "acme/tok", tok)
    info = _resolve_offline(cache, str(default_gguf), "acme/tok")
    assert info["tokenizer"] == str(snapshot)
    assert info["chat_template"] == "{{ messages[0]['content'] }}" and info["add_bos_token"]


def test_generation_config_fills_only_what_a_request_leaves_out(
    model_with_generation_config: Path,
) -> None:
    from gapless.common.config import EngineConfig

    info = resolve_model(str(model_with_generation_config))
    config = EngineConfig(model=info, served_model_name="tiny")
    plain = sampling_params(CompletionRequest(prompt="x"), 1, None, config)
    assert (plain.temperature, plain.top_p, plain.top_k) == (0.6, 0.9, 20)
    assert plain.min_p == 0.0 and plain.repetition_penalty == 1.0  # not in the file
    asked = sampling_params(CompletionRequest(prompt="x", temperature=0, top_k=-1), 1, None, config)
    assert (asked.temperature, asked.top_p, asked.top_k) == (0.0, 0.9, 0)
    bare = msgspec.structs.replace(info, sampling_defaults={})
    none = sampling_params(
        CompletionRequest(prompt="x"), 1, None, EngineConfig(model=bare, served_model_name="t")
    )
    assert (none.temperature, none.top_p) == (1.0, 1.0)
