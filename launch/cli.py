"""`gapless serve` and `gapless bench`."""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
import types
import typing
from collections.abc import Callable, Iterator
from typing import Annotated, Any, Literal

import msgspec
from msgspec.structs import FieldInfo

from gapless.common.config import (
    DEVICE_DEFAULTS,
    EngineConfig,
    TenantSpec,
    check_tenant_name,
    encode_config,
)
from gapless.gpu_runner.sim.profiles import list_profiles
from gapless.launch.keys_file import KeysFile, read_keys_file
from gapless.launch.lora_args import add_lora_args, with_lora
from gapless.launch.speculative_config import check_draft_model, parse_speculative_config

# why: the config reaches every process in one environment variable, which Linux caps at
# 128 KiB (MAX_ARG_STRLEN), name included
MAX_CONFIG_BYTES = 128 * 2**10 - 64
_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "ki": 2**10, "mi": 2**20, "gi": 2**30}


def parse_bytes(text: str) -> int:
    """'512MiB', '2G', '1.5GiB' or a plain number of bytes."""
    m = re.fullmatch(r"\s*([\d.]+)\s*([kmg]i?)?b?\s*", text.lower())
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 512MiB or 2GiB)")
    return int(float(m.group(1)) * _UNITS[m.group(2) or ""])


def format_bytes(n: int) -> str:
    """512 * 2**20 -> '512MiB': the largest binary unit that divides n."""
    for unit in ("gi", "mi", "ki"):
        if n and n % _UNITS[unit] == 0:
            return f"{n // _UNITS[unit]}{unit.capitalize()}B"
    return str(n)


def default_threads() -> int:
    # measured on 2 cores, 32 x 128:128 through HTTP: 2 threads 133.7 tok/s, 1 thread 106.8 tok/s;
    # the other roles are light and run at lower priority, so the runner takes every core
    return max(1, os.cpu_count() or 1)


def parse_tenant_weight(text: str) -> tuple[str, float]:
    """'acme=2' -> ('acme', 2.0)."""
    name, _, weight = text.rpartition("=")
    try:
        value = float(weight)
        check_tenant_name(name)
    except ValueError:
        value = math.nan
    if not name or not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(
            f"expected NAME=W, a tenant name and a positive weight, got {text!r}"
        )
    return name, value


# hooks a field's Meta(extra=...) names, resolved here so that config.py imports no role
PARSERS: dict[str, tuple[Callable[[str], Any], Callable[[Any], str]]] = {
    "bytes": (parse_bytes, format_bytes),  # (parse the flag, show the default)
}
CHOICES: dict[str, Callable[[], list[str]]] = {"sim_profiles": list_profiles}
DEFAULTS: dict[str, Callable[[], Any]] = {"all_cores": default_threads}


def config_flags(cls: type[msgspec.Struct]) -> Iterator[tuple[FieldInfo, str, dict[str, Any]]]:
    """(field, description, extra) of every field of cls that is a flag."""
    for field in msgspec.structs.fields(cls):
        metas = [m for m in getattr(field.type, "__metadata__", ()) if isinstance(m, msgspec.Meta)]
        extra = {k: v for m in metas for k, v in (m.extra or {}).items()}
        if extra.get("flag") is not False:
            yield field, " ".join(m.description for m in metas if m.description), extra


def _value_type(hint: Any) -> Any:
    """int for Annotated[int | None, Meta(...)] and Annotated[Annotated[int, Meta(ge=1)] | None,
    Meta(...)] (msgspec puts a bound on the int, not on the union)."""
    hint = typing.get_args(hint)[0] if typing.get_origin(hint) is Annotated else hint
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        (hint,) = [a for a in typing.get_args(hint) if a is not type(None)]
    return typing.get_args(hint)[0] if typing.get_origin(hint) is Annotated else hint


def _checked(parse: Callable[[str], Any], hint: Any) -> Callable[[str], Any]:
    """parse, then the field's constraints (Meta(ge=1), ...) as msgspec checks them."""

    def convert(text: str) -> Any:
        try:
            return msgspec.convert(parse(text), hint)
        except msgspec.ValidationError as e:
            raise argparse.ArgumentTypeError(f"{e} (got {text})") from None

    convert.__name__ = parse.__name__  # argparse names it in "invalid int value: 'x'"
    return convert


def add_config_flags(p: argparse.ArgumentParser, cls: type[msgspec.Struct] = EngineConfig) -> None:
    """One flag per field of cls: --field-name (or extra flag), its type, default and help."""
    for field, description, extra in config_flags(cls):
        assert field.default is not msgspec.NODEFAULT, f"flag {field.name} needs a default"
        name = "--" + extra.get("flag", field.name.replace("_", "-"))
        kind = _value_type(field.type)
        default = DEFAULTS[extra["default"]]() if "default" in extra else field.default
        default = os.environ.get(extra["env"], default) if "env" in extra else default
        text = description.replace("%", "%%")  # argparse %-formats help
        if kind is bool:  # a switch away from the default: --no-overlap for a True field
            what = field.name.replace("_", " ")
            help_ = (
                f"{extra.get('off', description)} (default: {what} on)"
                if default
                else f"{description} (default: off)"
            )
            p.add_argument(
                name.replace("--", "--no-") if default else name,
                dest=field.name,
                action="store_false" if default else "store_true",
                help=help_.replace("%", "%%"),
            )
            continue
        parse, show = PARSERS[extra["parse"]] if "parse" in extra else (kind, str)
        choices = CHOICES[extra["choices"]]() if "choices" in extra else None
        if typing.get_origin(kind) is Literal:
            choices = list(typing.get_args(kind))
            parse = type(choices[0])
        per_device = {d: v[field.name] for d, v in DEVICE_DEFAULTS.items() if field.name in v}
        if "env" in extra:  # why: help must not print the secret itself
            text += f" (default: ${extra['env']})"
        elif per_device:
            others = "; ".join(f"{show(v)} on {d}" for d, v in per_device.items())
            text += f" (default: {show(default)}; {others})"
        elif default is not None:
            text += f" (default: {show(default)})"
        if per_device:
            default = None  # config_from_args fills it in for the --device given
        p.add_argument(
            name,
            *("--" + alias for alias in extra.get("aliases", ())),
            dest=field.name,
            metavar=None if choices else extra.get("metavar", name[2:].upper().replace("-", "_")),
            type=parse if choices else _checked(parse, field.type),  # argparse names choices
            # a string default goes through type: "512MiB" -> 536870912
            default=show(default) if "parse" in extra and default is not None else default,
            choices=choices,
            help=text,
        )


def add_serve_args(p: argparse.ArgumentParser, cls: type[EngineConfig] = EngineConfig) -> None:
    # the model flags resolve a ModelInfo; every other flag comes from EngineConfig's fields
    p.add_argument(
        "--model",
        help="Hugging Face directory, Hub id (org/name, from the local Hub cache; fetched "
        "unless HF_HUB_OFFLINE=1) or .gguf file (default: SmolLM2-135M-Instruct)",
    )
    p.add_argument(
        "--tokenizer",
        help="tokenizer directory or Hub id, when not the model's own (default: the model's)",
    )
    p.add_argument("--served-model-name", help="model name clients send (default: from --model)")
    p.add_argument(
        "--max-model-len", type=int, help="cap on the model's context length (default: none)"
    )
    add_config_flags(p, cls)
    # why by hand: a repeated flag that fills EngineConfig.tenants with --api-keys-file
    p.add_argument(
        "--tenant-weight",
        action="append",
        metavar="NAME=W",
        type=parse_tenant_weight,
        help="the tenant NAME gets W times the fair share of a tenant of weight 1; repeat it for "
        "more tenants; overrides the keys file's weight (default: every tenant weighs 1)",
    )
    # why by hand: vLLM's JSON form of --speculative and --num-speculative-tokens
    p.add_argument(
        "--speculative-config",
        metavar="JSON",
        type=parse_speculative_config,
        help='vLLM\'s speculative config, such as \'{"method": "suffix", '
        '"num_speculative_tokens": 4}\', for the methods gapless has (ngram, suffix, '
        'draft_model with "model"); its values win over --speculative, --speculative-model '
        "and --num-speculative-tokens",
    )
    add_lora_args(p)


def check_tensor_parallel(config: EngineConfig) -> None:
    """ValueError naming the flag when --tensor-parallel-size cannot split this model here."""
    from gapless.common.model_files import load_arch
    from gapless.common.shards import split_problem

    size, hosts = config.tensor_parallel_size, config.nnodes
    if size % hosts:
        raise ValueError(f"--nnodes {hosts} must divide --tensor-parallel-size {size}")
    if config.node_rank >= hosts:
        raise ValueError(f"--node-rank {config.node_rank} must be below --nnodes {hosts}")
    if hosts > 1 and not config.master_port:
        raise ValueError("--nnodes above 1 needs --master-port (host 0's, the same on every host)")
    if config.headless != (config.node_rank > 0):
        raise ValueError("--headless runs the ranks of a --node-rank above 0, and only there")
    if config.device == "sim" and hosts > 1:
        raise ValueError("--nnodes runs on --device cpu and cuda (sim has no ranks to spread)")
    if size == 1 or config.device == "sim":  # sim: the profile's timing at `size` GPUs
        return
    if config.quantization not in ("auto", "none"):
        raise ValueError("--quantization is not available with --tensor-parallel-size yet")
    problem = split_problem(load_arch(config.model), size)
    if problem:
        raise ValueError(f"--tensor-parallel-size {size}: {problem}")


def check_data_parallel(config: EngineConfig) -> None:
    """ValueError naming the flag when --data-parallel-size cannot run as asked."""
    if config.data_parallel_size > 1 and config.nnodes > 1:
        raise ValueError("--data-parallel-size runs its replicas on one host (not with --nnodes)")


def config_from_args(
    args: argparse.Namespace, cls: type[EngineConfig] = EngineConfig
) -> EngineConfig:
    from gapless.common.hub import is_hub_id
    from gapless.common.model_cache import DEFAULT_NAME
    from gapless.common.model_check import check_model
    from gapless.common.model_files import model_path, resolve_model

    keys, tenants, admin = (
        read_keys_file(args.api_keys_file) if args.api_keys_file else KeysFile({}, {}, ())
    )
    for tenant, weight in args.tenant_weight or ():
        tenants[tenant] = msgspec.structs.replace(tenants.get(tenant, TenantSpec()), weight=weight)
    path = model_path(args.model)
    # why before resolve_model and any spawn: a bad file is refused from its headers, in
    # bounded time and memory, not by a process that builds what it claims. sim reads no
    # weights: a GGUF there may be a tokenizer alone (bench/gpu_check's)
    if args.device != "sim" or path.is_dir():
        check_model(path)
    info = resolve_model(str(path), args.max_model_len, args.tokenizer)
    if args.served_model_name:
        name = args.served_model_name
    elif args.model and is_hub_id(args.model):
        name = args.model
    elif args.model:
        name = os.path.basename(os.path.normpath(args.model)).removesuffix(".gguf")
    else:
        name = DEFAULT_NAME
    flags = {field.name: getattr(args, field.name) for field, _, _ in config_flags(cls)}
    for field, _, _ in config_flags(cls):  # a flag left out whose default depends on --device
        if flags[field.name] is None and any(field.name in v for v in DEVICE_DEFAULTS.values()):
            by_device = DEVICE_DEFAULTS.get(flags["device"], {})
            flags[field.name] = by_device.get(field.name, field.default)
    flags.update(getattr(args, "speculative_config", None) or {})
    config = cls(
        model=info,
        served_model_name=name,
        api_keys=keys,
        admin_keys=admin,
        tenants=tenants,
        **flags,
    )
    config = with_lora(config, args.lora_modules, args.lora_dir)
    check_tensor_parallel(config)
    check_data_parallel(config)
    config = check_draft_model(config)
    size = len(encode_config(config).encode())
    if size > MAX_CONFIG_BYTES:
        raise ValueError(
            f"the configuration is {size} bytes, more than the {MAX_CONFIG_BYTES} that can reach "
            f"the engine processes ({len(keys)} API keys, {len(tenants)} tenants)"
        )
    return config


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:  # the bench CLI owns its own flags (it is `gapless-bench`)
        # why a new program: the serving path does not import the bench
        os.execv(sys.executable, [sys.executable, "-m", "gapless.bench.cli", *argv[1:]])
    parser = argparse.ArgumentParser(prog="gapless", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve_p = sub.add_parser("serve", help="start the OpenAI-compatible server")
    add_serve_args(serve_p)
    sub.add_parser("bench", help="measure a server: TTFT, throughput, device idle (bench --help)")
    args = parser.parse_args(argv)
    if args.command == "serve":
        from gapless.launch.supervisor import serve

        try:
            config = config_from_args(args)
        except (ValueError, FileNotFoundError, NotImplementedError, RuntimeError) as e:
            parser.exit(2, f"gapless: {e}\n")
        sys.exit(serve(config))


if __name__ == "__main__":
    main()
