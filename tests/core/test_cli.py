"""`gapless serve` flags generated from EngineConfig's fields."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from typing import Annotated

import msgspec
import pytest

from gapless.core.common import model_files
from gapless.core.common.config import EngineConfig, ModelInfo, decode_config, encode_config
from gapless.core.launch.cli import add_serve_args, config_from_args, default_threads

MODEL = ModelInfo(
    path="m.gguf", architecture="llama", vocab_size=10, max_model_len=64, eos_token_ids=(2,)
)
# every `gapless serve` flag and the default its help shows (None: shows none)
FLAGS = {
    "--model": "SmolLM2-135M-Instruct",
    "--served-model-name": "from --model",
    "--max-model-len": "none",
    "--device {cpu,sim,cuda}": "cpu",
    "--dtype {bfloat16,float32,float16}": "bfloat16",
    "--max-num-seqs": "64",
    "--max-num-batched-tokens": "512",
    "--block-size": "16",
    "--kv-cache-memory": "512MiB",
    "--no-overlap": "on",
    "--threads": str(default_threads()),
    "--seed": "0",
    "--sim-profile": "h100-llama3-8b",
    "--no-cuda-graph": "on",
    "--trace-file": None,
    "--host": "127.0.0.1",
    "--port": "8000",
    "--api-key": "$GAPLESS_API_KEY",
    "--api-servers": "1",
    "--max-logprobs": "20",
    "--max-n": "8",
    "--drain-timeout": "30.0",
}
WIDE = "1000"  # columns, so no help line wraps


class Extended(EngineConfig, frozen=True, kw_only=True):
    new_knob: Annotated[int, msgspec.Meta(description="a knob", ge=0)] = 3


@pytest.fixture(autouse=True)
def env(monkeypatch):
    monkeypatch.setenv("COLUMNS", WIDE)
    monkeypatch.setenv("GAPLESS_API_KEY", "sekrit")
    # why: no model files read; config_from_args imports resolve_model when called
    monkeypatch.setattr(model_files, "resolve_model", lambda model, max_model_len=None: MODEL)


def serve_parser(cls: type[EngineConfig] = EngineConfig) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gapless serve")
    add_serve_args(p, cls)
    return p


def serve_config(*argv: str, cls: type[EngineConfig] = EngineConfig) -> EngineConfig:
    return config_from_args(serve_parser(cls).parse_args(argv), cls)


def help_entries(text: str) -> dict[str, str]:
    """{'--port PORT': 'port the HTTP server listens on (default: 8000)', ...}"""
    entries: dict[str, str] = {}
    for line in text.split("options:\n")[1].splitlines():
        if line.startswith("  -"):
            head, _, rest = line.strip().partition("  ")
            entries[head] = rest.strip()
        else:
            entries[head] = (entries[head] + " " + line.strip()).strip()
    return entries


def entry(entries: dict[str, str], flag: str) -> str:
    (found,) = [text for head, text in entries.items() if (head + " ").startswith(flag + " ")]
    return found


def test_help_lists_every_flag_with_its_default():
    entries = help_entries(serve_parser().format_help())
    assert len(entries) == len(FLAGS) + 1  # and -h
    for flag, default in FLAGS.items():
        text = entry(entries, flag)
        assert (f"(default: {default})" in text) if default else "(default:" not in text, text
    assert "sekrit" not in str(entries)
    for field in ("--run-dir", "--max-body-bytes", "--max-stop-strings", "--dead-engine-grace"):
        assert not any(head.startswith(field) for head in entries)


def test_gapless_serve_help_is_the_generated_help():
    out = subprocess.run(
        [sys.executable, "-m", "gapless.core.launch.cli", "serve", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ, COLUMNS=WIDE),
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout == serve_parser().format_help()


def test_defaults_are_the_configs():
    config = serve_config()
    expected = EngineConfig(
        model=MODEL,
        served_model_name="SmolLM2-135M-Instruct",
        threads=default_threads(),
        api_key="sekrit",
    )
    assert config == expected
    assert decode_config(encode_config(config)) == config


def test_a_new_field_is_a_new_flag():
    text = entry(help_entries(serve_parser(Extended).format_help()), "--new-knob")
    assert text == "a knob (default: 3)"
    assert serve_config(cls=Extended) == Extended(
        model=MODEL,
        served_model_name="SmolLM2-135M-Instruct",
        threads=default_threads(),
        api_key="sekrit",
    )
    config = serve_config("--new-knob", "7", cls=Extended)
    assert isinstance(config, Extended) and config.new_knob == 7


def test_flags_become_fields():
    config = serve_config(
        "--no-overlap",
        "--no-cuda-graph",
        "--drain-timeout",
        "5",
        "--kv-cache-memory",
        "1GiB",
        "--device",
        "sim",
        "--trace-file",
        "t.json",
        "--api-key",
        "k",
        "--model",
        "dir/m.gguf",
    )
    assert (config.overlap, config.cuda_graph) == (False, False)
    assert config.drain_timeout_s == 5.0 and isinstance(config.drain_timeout_s, float)
    assert config.kv_cache_memory == 2**30
    assert (config.device, config.trace_file, config.api_key) == ("sim", "t.json", "k")
    assert config.served_model_name == "m"


@pytest.mark.parametrize(
    "flag",
    ["--max-num-seqs", "--max-num-batched-tokens", "--block-size", "--threads", "--api-servers"],
)
def test_counts_below_one_are_refused(flag, capsys):
    with pytest.raises(SystemExit) as e:
        serve_config(flag, "0")
    assert e.value.code == 2
    assert f"argument {flag}: Expected `int` >= 1" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, error",
    [
        (["--device", "tpu"], "argument --device: invalid choice: 'tpu'"),
        (["--sim-profile", "x"], "argument --sim-profile: invalid choice: 'x'"),
        (["--port", "http"], "argument --port: invalid int value: 'http'"),
        (["--kv-cache-memory", "lots"], "argument --kv-cache-memory: not a size: 'lots'"),
    ],
)
def test_bad_values_name_the_flag(argv, error, capsys):
    with pytest.raises(SystemExit):
        serve_config(*argv)
    assert error in capsys.readouterr().err
