from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from gapless.common.model_cache import default_model_path
from tests.server import SERVER_BUDGET, SERVER_COUNTS_ENV, servers_started

_SERVER_COUNTS = pytest.StashKey[Path]()
_SERVERS_STARTED = pytest.StashKey[int]()


def pytest_configure(config: pytest.Config) -> None:
    """The run's first process makes the folder where every process counts the servers it
    starts (tests/server.py); xdist's workers, started after this, inherit its name."""
    if hasattr(config, "workerinput"):
        return
    folder = Path(tempfile.mkdtemp(prefix="gapless-test-servers-"))
    os.environ[SERVER_COUNTS_ENV] = str(folder)
    config.stash[_SERVER_COUNTS] = folder


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Past SERVER_BUDGET servers started, all processes summed, the run fails."""
    folder = session.config.stash.get(_SERVER_COUNTS, None)
    if folder is None:
        return
    started = servers_started(folder)
    shutil.rmtree(folder, ignore_errors=True)
    session.config.stash[_SERVERS_STARTED] = started
    if started > SERVER_BUDGET:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    started = config.stash.get(_SERVERS_STARTED, None)
    if not started:
        return
    line = f"servers started: {started} (budget {SERVER_BUDGET}, tests/server.py)"
    if started <= SERVER_BUDGET:
        terminalreporter.write_line(line)
        return
    terminalreporter.write_line(
        f"FAILED: {line}: this run started more servers than its budget; share a server "
        "between tests (a module- or session-scoped fixture), or raise SERVER_BUDGET with the "
        "reason in its comment",
        red=True,
        bold=True,
    )


@pytest.fixture(scope="session")
def default_gguf() -> Path:
    """The default SmolLM2 GGUF, fetched into the cache on first use."""
    return default_model_path()


def sim_config(model_path, **overrides):
    """An EngineConfig for the sim device on the default model's tokenizer and context."""
    from gapless.common.config import EngineConfig
    from gapless.common.model_files import resolve_model

    fields = dict(served_model_name="sim", device="sim", max_num_seqs=8, block_size=16)
    return EngineConfig(model=resolve_model(str(model_path)), **{**fields, **overrides})


TINY_LLAMA = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)


def build_tiny_llama(out: Path, default_gguf: Path, seed: int = 1234, **shape) -> Path:
    """A random Llama in `out` as a Hugging Face directory, with SmolLM2's real tokenizer;
    `seed` draws its weights."""
    import torch
    import transformers

    from gapless.common.model_files import load_tokenizer, resolve_model

    info = resolve_model(str(default_gguf))
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=info.vocab_size,
        max_position_embeddings=2048,
        rope_theta=10000.0,
        bos_token_id=1,
        eos_token_id=2,
        **{"tie_word_embeddings": True, **TINY_LLAMA, **shape},
    )
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():  # sharper logits than the default init, so greedy has clear winners
        model.model.embed_tokens.weight.normal_(0, 1.0)
    model.save_pretrained(out, safe_serialization=True)
    load_tokenizer(info).save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "chat_template": info.chat_template,
                "eos_token": "<|im_end|>",
                "bos_token": "<|im_start|>",
                "add_bos_token": False,
            }
        )
    )
    return out


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, default_gguf) -> Path:
    """A tiny random Llama (head_dim 16) as a Hugging Face directory, with SmolLM2's tokenizer."""
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), default_gguf)


def pytest_collection_modifyitems(config, items) -> None:
    """Modules holding a test marked slow (servers, the default model) first, each module's
    tests kept together and in order: on pytest-xdist workers the long tests start early and
    the short ones fill in at the end, instead of one worker finishing a long test alone."""
    slow_modules = {item.module for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.module not in slow_modules)
    # a module marked randomly_dont_reorganize gets its file order back in its own places
    # (pytest-randomly shuffled it before this hook ran)
    kept: dict[object, list[int]] = {}
    for i, item in enumerate(items):
        if item.get_closest_marker("randomly_dont_reorganize"):
            kept.setdefault(item.module, []).append(i)
    for places in kept.values():
        in_order = sorted((items[i] for i in places), key=lambda item: item.location[1])
        for i, item in zip(places, in_order, strict=True):
            items[i] = item
