"""`gapless serve`'s LoRA flags in vLLM's spellings: --lora-modules NAME=PATH ... (or vLLM's
JSON form), which implies --enable-lora; the adapters are read and held to the model at start,
so a bad one stops the server with its reason, before any process is spawned. --lora-dir ROOT
turns on loading at run time (POST /v1/load_lora_adapter) from under ROOT, and only with an
admin key to guard it: without keys every caller is admin."""

from __future__ import annotations

import argparse
import os

import msgspec

from gapless.common.config import EngineConfig
from gapless.common.lora import parse_lora_module


def _module(text: str) -> tuple[str, str]:
    try:
        return parse_lora_module(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{e} (got {text!r})") from None


def add_lora_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--lora-modules",
        nargs="+",
        action="extend",
        metavar="NAME=PATH",
        type=_module,
        help="LoRA adapters to serve (peft directories or llama.cpp GGUF LoRA files), each "
        "named by requests' `model`; "
        'NAME=PATH or {"name": ..., "path": ...}; implies --enable-lora (default: none)',
    )
    p.add_argument(
        "--lora-dir",
        action="append",
        metavar="ROOT",
        help="a directory POST /v1/load_lora_adapter may read adapters from (repeat for more); "
        "implies --enable-lora and needs an admin key (default: no loading at run time)",
    )


def with_lora(
    config: EngineConfig, modules: list[tuple[str, str]] | None, dirs: list[str] | None = None
) -> EngineConfig:
    """config with --lora-modules and --lora-dir, the adapters checked against the model;
    ValueError naming the flag, adapter or tenant."""
    if dirs:
        config = _with_dirs(config, dirs)
    named: dict[str, str] = {}
    for name, path in modules or ():
        if name in named or name == config.served_model_name:
            raise ValueError(f"--lora-modules: the name {name!r} is taken")
        named[name] = path
    if named:
        config = msgspec.structs.replace(config, lora_modules=named, enable_lora=True)
    for tenant, spec in config.tenants.items():
        unknown = [a for a in spec.lora_adapters if a not in named]
        if unknown and not config.lora_dirs:
            raise ValueError(f"--api-keys-file: tenant {tenant!r} names LoRA adapters that "
                             f"--lora-modules does not serve: {', '.join(unknown)}")  # fmt: skip
    if not config.enable_lora:
        return config
    if config.device == "cuda" or config.tensor_parallel_size > 1:
        raise ValueError("--enable-lora: adapters run on --device cpu (and sim), one rank, so far")
    _check_adapters(config)
    return config


def _with_dirs(config: EngineConfig, dirs: list[str]) -> EngineConfig:
    """--lora-dir's roots, each an existing directory with its links resolved; refused
    without an admin key (--admin-api-key, or "admin": true in --api-keys-file)."""
    if not (config.admin_keys or config.admin_api_key):
        raise ValueError("--lora-dir: loading adapters at run time needs an admin key "
                         '(--admin-api-key, or "admin": true in --api-keys-file): without '
                         "one every caller is admin")  # fmt: skip
    roots = []
    for d in dirs:
        root = os.path.realpath(d)
        if not os.path.isdir(root):
            raise ValueError(f"--lora-dir {d}: not a directory")
        roots.append(root)
    return msgspec.structs.replace(config, lora_dirs=tuple(roots), enable_lora=True)


def _check_adapters(config: EngineConfig) -> None:
    if config.device == "sim" and not config.lora_modules:
        return
    from gapless.common.model_files import load_arch
    from gapless.gpu_runner.lora.adapter import AdapterError, load_adapter

    arch = load_arch(config.model)
    for name, path in config.lora_modules.items():
        try:
            load_adapter(name, path, arch, config.max_lora_rank)
        except AdapterError as e:
            raise ValueError(f"--lora-modules {name}: {e}") from None
