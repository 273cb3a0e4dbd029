"""`gapless serve` flags generated from EngineConfig's fields."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Annotated

import msgspec
import pytest

from gapless.common import model_check, model_files
from gapless.common.config import (
    EngineConfig,
    ModelInfo,
    TenantSpec,
    decode_config,
    encode_config,
)
from gapless.launch.cli import add_serve_args, config_from_args, default_threads, main

MODEL = ModelInfo(
    path="m.gguf", architecture="llama", vocab_size=10, max_model_len=64, eos_token_ids=(2,)
)
# every `gapless serve` flag and the default its help shows (None: shows none)
FLAGS = {
    "--model": "SmolLM2-135M-Instruct",
    "--tokenizer": "the model's",
    "--served-model-name": "from --model",
    "--max-model-len": "none",
    "--device {cpu,sim,cuda}": "cpu",
    "--dtype {auto,bfloat16,float32,float16}": "auto",
    "--quantization {auto,none,int8,int4,w8a8,int4-dual}": "auto",
    "--max-num-seqs": "64; 256 on cuda",
    "--max-num-batched-tokens": "512; 8192 on cuda",
    "--block-size": "16",
    "--kv-cache-memory": "512MiB on cpu; on cuda, what --gpu-memory-utilization leaves",
    "--gpu-memory-utilization": "0.9",
    "--no-overlap": "overlap on",
    "--speculative": "off",
    "--speculative-model PATH": None,
    "--num-speculative-tokens": "4",
    "--deep-plan-ms": "4.0",
    "--no-prefix-caching": "prefix caching on",
    "--shared-prefix-cache": "off",
    "--kv-events-endpoint ADDR": None,
    "--kv-events-replay-endpoint ADDR": None,
    "--kv-events-topic TOPIC": None,
    "--scheduling-policy {fair,priority,fcfs}": "fair",
    "--fair-output-weight": "2.0",
    "--priority-aging": "30.0",
    "--stall-timeout S": "5.0",
    "--max-queue-wait S": None,
    "--max-queued-requests N": None,
    "--max-queued-tokens TOKENS": None,
    "--threads": str(default_threads()),
    "--tensor-parallel-size N, --tp N": "1",
    "--data-parallel-size M, --dp M": "1",
    "--dist-timeout S": "120.0",
    "--nnodes N": "1",
    "--node-rank": "0",
    "--master-addr ADDR": "127.0.0.1",
    "--master-port PORT": "0",
    "--headless": "off",
    "--cpu-wait {short,passive,spin}": "short",
    "--seed": "0",
    "--sim-profile": "h100-llama3-8b",
    "--sim-time-scale": "1.0",
    "--no-cuda-graph": "cuda graph on",
    "--no-compile": "compile on",
    "--no-attention-kernel": "attention kernel on",
    "--trace-file": None,
    "--host": "127.0.0.1",
    "--port": "8000",
    "--api-key": "$GAPLESS_API_KEY",
    "--admin-api-key": "$GAPLESS_ADMIN_API_KEY",
    "--api-servers": "1",
    "--max-logprobs": "20",
    "--metrics-require-key": "off",
    "--max-n": "8",
    "--stream-buffer-events N": "1024",
    "--stream-write-timeout S": "30.0",
    "--sse-keepalive S": "15.0",
    "--max-prompts": "64",
    "--tool-call-parser {hermes}": "hermes",
    "--grammar-workers N": "2",
    "--grammar-memory GRAMMAR_MEMORY": "256MiB",
    "--chat-template FILE": None,
    "--header-timeout S": "20.0",
    "--body-timeout S": "20.0",
    "--body-min-rate BYTES": "500",
    "--keep-alive-timeout S": "120.0",
    "--max-connections N": None,
    "--drain-timeout": "30.0",
    "--log-level {debug,info,warning,error}": "info",
    "--log-format {text,json}": "text",
    "--stats-interval S": "10.0",
    "--api-keys-file FILE": None,
    "--responses-store PATH": None,
    "--responses-store-days DAYS": "30.0",
    "--responses-store-bytes RESPONSES_STORE_BYTES": "1GiB",
    "--tenant-weight NAME=W": "every tenant weighs 1",
    "--speculative-config JSON": None,
    "--enable-lora": "off",
    "--max-loras MAX_LORAS": "1",
    "--max-lora-rank MAX_LORA_RANK": "16",
    "--max-cpu-loras MAX_CPU_LORAS": "every loaded one",
    "--lora-modules NAME=PATH": "none",
    "--lora-dir ROOT": "no loading at run time",
}
WIDE = "1000"  # columns, so no help line wraps


class Extended(EngineConfig, frozen=True, kw_only=True):
    new_knob: Annotated[int, msgspec.Meta(description="a knob", ge=0)] = 3


@pytest.fixture(autouse=True)
def env(monkeypatch):
    monkeypatch.setenv("COLUMNS", WIDE)
    monkeypatch.setenv("GAPLESS_API_KEY", "sekrit")
    # why: no model files read; config_from_args imports these when called
    monkeypatch.setattr(
        model_files, "resolve_model", lambda model, max_model_len=None, tokenizer=None: MODEL
    )
    monkeypatch.setattr(model_files, "model_path", lambda model: Path(model or "default.gguf"))
    monkeypatch.setattr(model_check, "check_model", lambda path: None)


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
        [sys.executable, "-m", "gapless.launch.cli", "serve", "--help"],
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
        "--deep-plan-ms",
        "0",
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
    assert (config.overlap, config.cuda_graph, config.deep_plan_ms) == (False, False, 0.0)
    assert config.drain_timeout_s == 5.0 and isinstance(config.drain_timeout_s, float)
    assert config.kv_cache_memory == 2**30
    assert (config.device, config.trace_file, config.api_key) == ("sim", "t.json", "k")
    assert config.served_model_name == "m"


@pytest.mark.parametrize(
    "flag",
    [
        "--max-num-seqs",
        "--max-num-batched-tokens",
        "--block-size",
        "--threads",
        "--api-servers",
        "--max-queued-requests",
        "--max-queued-tokens",
    ],
)
def test_counts_below_one_are_refused(flag, capsys):
    with pytest.raises(SystemExit) as e:
        serve_config(flag, "0")
    assert e.value.code == 2
    assert f"argument {flag}: Expected `int` >= 1" in capsys.readouterr().err


def test_scheduling_defaults_depend_on_the_device():
    cpu, sim, cuda = (serve_config("--device", d) for d in ("cpu", "sim", "cuda"))
    assert (cpu.max_num_seqs, cpu.max_num_batched_tokens) == (64, 512)
    assert (sim.max_num_seqs, sim.max_num_batched_tokens) == (64, 512)
    assert (cuda.max_num_seqs, cuda.max_num_batched_tokens) == (256, 8192)
    assert cpu.kv_cache_memory is cuda.kv_cache_memory is None  # each device sizes its own
    given = serve_config("--device", "cuda", "--max-num-seqs", "32", "--kv-cache-memory", "2GiB")
    assert (given.max_num_seqs, given.max_num_batched_tokens) == (32, 8192)
    assert given.kv_cache_memory == 2 * 2**30 and given.gpu_memory_utilization == 0.9


@pytest.mark.parametrize("value", ["0", "1.5", "-0.2"])
def test_gpu_memory_utilization_is_a_share(value, capsys):
    with pytest.raises(SystemExit):
        serve_config("--gpu-memory-utilization", value)
    assert "--gpu-memory-utilization" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, error",
    [
        (["--device", "tpu"], "argument --device: invalid choice: 'tpu'"),
        (["--sim-profile", "x"], "argument --sim-profile: invalid choice: 'x'"),
        (["--port", "http"], "argument --port: invalid int value: 'http'"),
        (["--kv-cache-memory", "lots"], "argument --kv-cache-memory: not a size: 'lots'"),
        (["--scheduling-policy", "lottery"], "argument --scheduling-policy: invalid choice"),
        (["--priority-aging", "0"], "argument --priority-aging: Expected `float` > 0.0"),
        (["--fair-output-weight", "-1"], "argument --fair-output-weight: Expected `float` >= 0"),
    ],
)
def test_bad_values_name_the_flag(argv, error, capsys):
    with pytest.raises(SystemExit):
        serve_config(*argv)
    assert error in capsys.readouterr().err


def test_scheduling_flags_become_fields():
    config = serve_config(
        "--scheduling-policy", "fcfs", "--fair-output-weight", "1", "--priority-aging", "5"
    )
    assert config.scheduling_policy == "fcfs"
    assert (config.fair_output_weight, config.priority_aging_s) == (1.0, 5.0)
    defaults = serve_config()
    assert (defaults.scheduling_policy, defaults.fair_output_weight) == ("fair", 2.0)
    assert (defaults.priority_aging_s, defaults.tenants, defaults.api_keys) == (30.0, {}, {})


def test_admission_flags_become_fields():
    config = serve_config(
        "--max-queued-requests", "50", "--max-queued-tokens", "8000", "--metrics-require-key"
    )
    assert (config.max_queued_requests, config.max_queued_tokens) == (50, 8000)
    assert config.metrics_require_key is True
    assert decode_config(encode_config(config)) == config
    assert serve_config().max_queued_requests is None


def test_tenant_weights_fill_tenants():
    config = serve_config(
        "--tenant-weight", "a=2", "--tenant-weight", "b=0.5", "--tenant-weight", "x=y=3"
    )
    assert config.tenants == {
        "a": TenantSpec(weight=2.0),
        "b": TenantSpec(weight=0.5),
        "x=y": TenantSpec(weight=3.0),
    }
    assert config.tenant_weights == {"a": 2.0, "b": 0.5, "x=y": 3.0}
    assert decode_config(encode_config(config)) == config


@pytest.mark.parametrize("value", ["x", "a=", "=2", "a=0", "a=-1", "a=nan", "a=inf", "a\x01=1"])
def test_bad_tenant_weight_names_the_flag(value, capsys):
    with pytest.raises(SystemExit) as e:
        serve_config("--tenant-weight", value)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "argument --tenant-weight: expected NAME=W" in err and repr(value) in err


def write_keys(tmp_path, data) -> str:
    path = tmp_path / "keys.json"
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(path)


def test_keys_file_fills_keys_and_tenants(tmp_path):
    path = write_keys(
        tmp_path,
        {
            "sk-a1": "acme",
            "sk-a2": {"tenant": "acme", "weight": 2, "priority": "interactive"},
            "sk-a3": {"tenant": "acme", "max_queued_requests": 100, "weight": 2.0},
            "sk-b1": {"tenant": "beta", "priority": 10},
            "sk-c1": "cats",
        },
    )
    config = serve_config(
        "--api-keys-file", path, "--tenant-weight", "beta=3", "--tenant-weight", "d=4"
    )
    assert config.api_keys == {
        "sk-a1": "acme",
        "sk-a2": "acme",
        "sk-a3": "acme",
        "sk-b1": "beta",
        "sk-c1": "cats",
    }
    assert config.tenants == {
        "acme": TenantSpec(weight=2.0, priority=-10, max_queued_requests=100),
        "beta": TenantSpec(weight=3.0, priority=10),  # --tenant-weight wins
        "cats": TenantSpec(),
        "d": TenantSpec(weight=4.0),
    }
    assert config.api_keys_file == path
    assert decode_config(encode_config(config)) == config


KEYS_FILE_ERRORS = [
    ('{"k1": "a", "k2": {"tenant": "b", "weight": 0}}', "entry 2: weight must be a positive"),
    ('{"k1": {"tenant": "b", "weight": -1}}', "entry 1: weight must be a positive"),
    ('{"k1": {"tenant": "b", "wieght": 2}}', "entry 1: Object contains unknown field `wieght`"),
    ('{"k1": {"weight": 2}}', "entry 1: Object missing required field `tenant`"),
    ('{"k1": 3}', "entry 1: Expected `str | object`, got `int`"),
    ('{"": "a"}', "entry 1: a key must be visible ASCII"),
    ('{"k1": "a", "k 2": "a"}', "entry 2: a key must be visible ASCII"),
    ('{"k1": ""}', "entry 1: the tenant name is empty"),
    ('{"k1": "a\\u0007"}', "entry 1: the tenant name holds a control character"),
    ('{"k1": {"tenant": "a", "priority": 1001}}', "entry 1: priority must be an integer from"),
    ('{"k1": {"tenant": "a", "priority": "urgent"}}', "entry 1: priority must be an integer from"),
    ('{"k1": {"tenant": "a", "priority": 1.5}}', "entry 1: Expected `int | str | null`"),
    ('{"k1": {"tenant": "a", "max_queued_requests": 0}}', "entry 1: Expected `int` >= 1"),
    (
        '{"k1": {"tenant": "a", "weight": 2}, "k2": "a", "k3": {"tenant": "a", "weight": 3}}',
        "entries 1 and 3 give tenant 'a' different weight values (2.0 and 3.0)",
    ),
    (
        '{"k1": {"tenant": "a", "priority": "batch"}, "k2": {"tenant": "a", "priority": 0}}',
        "entries 1 and 2 give tenant 'a' different priority values (10 and 0)",
    ),
    ("{}", "holds no keys"),
    ('["k1"]', "not a JSON object of keys"),
    ('{"k1": "a",}', "not a JSON object of keys"),
]


@pytest.mark.parametrize("text, error", KEYS_FILE_ERRORS)
def test_keys_file_errors_name_the_file_and_entry(tmp_path, text, error):
    path = write_keys(tmp_path, text)
    with pytest.raises(ValueError) as e:
        serve_config("--api-keys-file", path)
    assert str(e.value).startswith(f"--api-keys-file {path}: "), e.value
    assert error in str(e.value)
    assert "k1" not in str(e.value)  # the secret keys themselves are never printed


def test_serve_exits_2_on_a_bad_keys_file(tmp_path, capsys):
    bad = write_keys(tmp_path, '{"k1": {"tenant": "a", "weight": 0}}')
    missing = str(tmp_path / "missing.json")
    for path, error in ((bad, "entry 1: weight must be"), (missing, "cannot read it: No such")):
        with pytest.raises(SystemExit) as e:
            main(["serve", "--api-keys-file", path])
        assert e.value.code == 2
        assert capsys.readouterr().err.startswith(f"gapless: --api-keys-file {path}: {error}")


def test_a_config_too_large_for_the_environment_is_refused(tmp_path):
    path = write_keys(tmp_path, {f"sk-{i:020d}": f"tenant-{i}" for i in range(4000)})
    with pytest.raises(ValueError, match="4000 API keys, 4000 tenants"):
        serve_config("--api-keys-file", path)


def test_tp_is_the_tensor_parallel_size_and_a_split_it_cannot_make_is_refused(monkeypatch):
    """--tp and its split over hosts; what cannot be split or joined is named before any
    process starts."""
    from gapless.common.families.base import ModelArch

    arch = ModelArch(architecture="llama", vocab_size=10, hidden_size=64, intermediate_size=96,
                     num_layers=1, num_heads=9, num_kv_heads=3, head_dim=16, rope_theta=1e4,
                     rms_norm_eps=1e-5, max_position=64, tie_word_embeddings=True,
                     attention_bias=False)  # fmt: skip
    monkeypatch.setattr(model_files, "load_arch", lambda info: arch)
    assert serve_config("--tp", "3").tensor_parallel_size == 3
    assert serve_config("--tensor-parallel-size", "2").tensor_parallel_size == 2
    assert serve_config("--dp", "3").data_parallel_size == 3
    for count in ("0", "65"):
        with pytest.raises(SystemExit):
            serve_config("--dp", count)
    sim = serve_config("--tp", "4", "--device", "sim")  # the profile's timing at 4 GPUs
    assert sim.tensor_parallel_size == 4 and sim.num_ranks == 1
    refusals = {
        ("--tp", "4"): "--tensor-parallel-size 4: 4 ranks cannot share the model's 3 K/V heads",
        ("--tp", "2", "--nnodes", "2", "--master-port", "5000", "--device", "sim"): "sim has no",
        ("--tp", "2", "--quantization", "int8"): "--quantization is not available",
        ("--tp", "3", "--nnodes", "2", "--master-port", "5000"): "--nnodes 2 must divide",
        ("--tp", "2", "--nnodes", "2"): "needs --master-port",
        ("--tp", "2", "--nnodes", "2", "--master-port", "5000", "--node-rank", "1"): "--headless",
        ("--tp", "2", "--headless"): "--headless runs the ranks of a --node-rank above 0",
        ("--dp", "2", "--tp", "2", "--nnodes", "2", "--master-port", "5000"): "on one host",
    }
    for argv, why in refusals.items():
        with pytest.raises(ValueError, match=why):
            serve_config(*argv)


def test_serve_refuses_a_hostile_model_before_any_process_starts(tmp_path):
    """A config that claims a million layers over a 2-layer file: exit 2 naming the file and
    the key, from the model check (common/model_check.py) before the supervisor spawns
    anything (tests/common/test_model_check.py holds every other hostile file to it)."""
    from tests.hostile_models import write_hf

    model = write_hf(tmp_path / "m", num_hidden_layers=10**6)
    out = subprocess.run(
        [sys.executable, "-m", "gapless.launch.cli", "serve", "--model", str(model), "--device",
         "cpu"],
        capture_output=True,
        text=True,
        timeout=60,
    )  # fmt: skip
    assert out.returncode == 2, out.stderr
    assert out.stderr == (
        f"gapless: {model}/config.json: num_hidden_layers 1000000: the safetensors hold 2 layers\n"
    )
