"""`gapless serve`'s LoRA flags, in vLLM's spellings: --lora-modules NAME=PATH (or the JSON
form) implies --enable-lora; every adapter is read and held to the model at start, and a bad
one, a name taken twice, a keys file naming an adapter not served or a device without adapters
stop the start with the reason."""

from __future__ import annotations

import json
import os

import pytest

from gapless.common.lora import parse_lora_module
from tests.launch.test_cli import serve_config


@pytest.fixture(scope="module")
def adapter(tmp_path_factory, tiny_model_dir):
    """(model dir, a peft adapter on it)."""
    import transformers
    from peft import LoraConfig, get_peft_model

    base = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    out = tmp_path_factory.mktemp("lora")
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    get_peft_model(base, config).save_pretrained(out, safe_serialization=True)
    return tiny_model_dir, out


def test_both_forms_parse():
    assert parse_lora_module("sql=/srv/a") == ("sql", "/srv/a")
    text = '{"name": "sql", "path": "/srv/a", "base_model_name": "m"}'
    assert parse_lora_module(text) == ("sql", "/srv/a")
    for bad in ("sql", "=/srv/a", "a/b=/srv", '{"name": "x"}', "{oops"):
        with pytest.raises(ValueError):
            parse_lora_module(bad)


def test_lora_modules_imply_enable_lora(adapter):
    model, path = adapter
    config = serve_config("--model", str(model), "--lora-modules", f"sql={path}",
                          json.dumps({"name": "fr", "path": str(path)}), "--max-loras", "2")  # fmt: skip
    assert config.enable_lora and config.lora_modules == {"sql": str(path), "fr": str(path)}
    assert config.max_loras == 2 and config.max_lora_rank == 16
    assert not serve_config("--model", str(model)).enable_lora


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--max-lora-rank", "2"], "rank 4 is over --max-lora-rank 2"),
        (["--device", "cuda"], "--device cpu"),
        (["--lora-modules", "sql=/nowhere"], "not a directory"),
        (["--lora-modules", "sql=/a", "sql=/b"], "taken"),
    ],
)  # fmt: skip
def test_bad_adapters_stop_the_start(adapter, flags, words):
    model, path = adapter
    with pytest.raises(ValueError, match=words):
        serve_config("--model", str(model), "--lora-modules", f"a={path}", *flags)


def test_a_keys_file_names_only_served_adapters(adapter, tmp_path):
    model, path = adapter
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"sk-a": {"tenant": "a", "lora_adapters": ["sql", "gone"]}}))
    with pytest.raises(ValueError, match="does not serve: gone"):
        serve_config("--model", str(model), "--api-keys-file", str(keys), "--lora-modules",
                     f"sql={path}")  # fmt: skip
    keys.write_text(json.dumps({"sk-a": {"tenant": "a", "lora_adapters": ["sql"]}}))
    config = serve_config("--model", str(model), "--api-keys-file", str(keys), "--lora-modules",
                          f"sql={path}")  # fmt: skip
    assert config.tenants["a"].lora_adapters == ("sql",)


def test_a_malformed_module_is_a_usage_error(adapter, capsys):
    model, _ = adapter
    with pytest.raises(SystemExit):
        serve_config("--model", str(model), "--lora-modules", "no-path")
    assert "expected NAME=PATH" in capsys.readouterr().err


def test_lora_dir_needs_an_admin_key(adapter, tmp_path):
    """Loading at run time from --lora-dir is refused at start unless an admin key guards it
    (without keys every caller is admin); its roots are kept with links resolved, and the keys
    file may then name adapters that will be loaded later."""
    model, path = adapter
    os.symlink(path.parent, tmp_path / "link")
    flags = ("--model", str(model), "--lora-dir", str(tmp_path / "link"))
    (tmp_path / "keys.json").write_text(json.dumps({"sk-a": "a"}))
    with pytest.raises(ValueError, match="--lora-dir: .* needs an admin key"):
        serve_config(*flags, "--api-keys-file", str(tmp_path / "keys.json"))
    (tmp_path / "keys.json").write_text(json.dumps(
        {"sk-a": {"tenant": "a", "lora_adapters": ["later"]}, "sk-ops": {"tenant": "ops",
         "admin": True}}))  # fmt: skip
    config = serve_config(*flags, "--api-keys-file", str(tmp_path / "keys.json"),
                          "--max-cpu-loras", "2")  # fmt: skip
    assert config.lora_dirs == (os.path.realpath(path.parent),) and config.enable_lora
    assert config.max_cpu_loras == 2
    config = serve_config(*flags, "--admin-api-key", "root", "--lora-dir", str(path))
    assert config.lora_dirs == (os.path.realpath(path.parent), os.path.realpath(path))
    with pytest.raises(ValueError, match="not a directory"):
        serve_config("--model", str(model), "--admin-api-key", "k", "--lora-dir", "/nowhere")
