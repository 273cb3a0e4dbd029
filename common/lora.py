"""Which LoRA adapters a server serves and which of them a caller may name (docs/lora.md).

A request names an adapter in `model`. Without a keys file every adapter is every caller's;
with one, a tenant may use the adapters its entry lists (`lora_adapters`), and any other
adapter is, to it, a model that does not exist."""

from __future__ import annotations

import json

from gapless.common.config import EngineConfig


def parse_lora_module(text: str) -> tuple[str, str]:
    """--lora-modules' NAME=PATH, or vLLM's JSON form {"name": ..., "path": ...,
    "base_model_name": ...} -> (name, path); ValueError naming what is wrong."""
    text = text.strip()
    if text.startswith("{"):
        try:
            entry = json.loads(text)
        except ValueError as e:
            raise ValueError(f"not a JSON object: {e}") from None
        name, path = entry.get("name"), entry.get("path")
        if not isinstance(name, str) or not isinstance(path, str):
            raise ValueError('the JSON form needs "name" and "path" strings')
    else:
        name, sep, path = text.partition("=")
        if not sep:
            raise ValueError("expected NAME=PATH or a JSON object")
    if not name or not path or any(c.isspace() or c in "/\\" for c in name):
        raise ValueError("an adapter needs a name (no spaces or slashes) and a path")
    return name, path


def visible_adapters(
    config: EngineConfig, tenant: str, loaded: list[str] | None = None
) -> list[str]:
    """The adapters tenant may name, in loading order; loaded: the adapters served now (None:
    those of --lora-modules)."""
    names = list(config.lora_modules) if loaded is None else loaded
    if not config.api_keys:
        return names
    spec = config.tenants.get(tenant)
    allowed = set(spec.lora_adapters) if spec is not None else set()
    return [name for name in names if name in allowed]


def adapter_of(
    model: str | None, config: EngineConfig, tenant: str, loaded: list[str] | None = None
) -> str | None:
    """The adapter a request's `model` names ("" : the base model), or None where it names
    nothing this caller may use."""
    if model is None or model == config.served_model_name:
        return ""
    if model in visible_adapters(config, tenant, loaded):
        return model
    return None
