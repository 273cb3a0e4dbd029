"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter, with vLLM's request bodies
(docs/lora.md). Only with --lora-dir, only for an admin key; a path must lie under one of
--lora-dir's roots once its links are resolved. Every replica's core loads or unloads; the
answer comes once they have, so /v1/models lists the change at once."""

from __future__ import annotations

import os

import msgspec

from gapless.common.gguf_file import is_gguf
from gapless.common.lora import parse_lora_module
from gapless.common.messages import LoraAdapters
from gapless.frontend.api.state import FrontendState
from gapless.frontend.http.asgi import HttpRequest, Responder
from gapless.frontend.http.errors import ApiError, bad_request, decode_body

# the files of an adapter the runner reads (gpu_runner/lora/adapter.py)
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


class LoadLoraBody(msgspec.Struct, forbid_unknown_fields=True):
    lora_name: str
    lora_path: str
    load_inplace: bool = False


class UnloadLoraBody(msgspec.Struct, forbid_unknown_fields=True):
    lora_name: str
    lora_int_id: int | None = None  # vLLM's, ignored: an adapter goes by its name


_load = msgspec.json.Decoder(LoadLoraBody)
_unload = msgspec.json.Decoder(UnloadLoraBody)


def inside_roots(path: str, roots: tuple[str, ...]) -> str | None:
    """path with its links resolved, if it lies under one of roots (resolved), else None."""
    real = os.path.realpath(path)
    for root in roots:
        if os.path.commonpath([root, real]) == root:
            return real
    return None


def _check_name(name: str) -> None:
    try:
        parse_lora_module(f"{name}=x")
    except ValueError:
        raise bad_request("lora_name must be a name without spaces or slashes",
                          param="lora_name") from None  # fmt: skip


async def read_load(state: FrontendState, req: HttpRequest) -> tuple[str, str]:
    """The (name, resolved path) a load asks for, checked; a 400 naming the field if not."""
    config = state.config
    body = decode_body(_load, await req.body(config.max_body_bytes))
    _check_name(body.lora_name)
    if body.load_inplace:
        raise bad_request("load_inplace is not supported: unload the adapter, then load it",
                          param="load_inplace")  # fmt: skip
    if body.lora_name == config.served_model_name:
        raise bad_request(f"lora_name: {body.lora_name!r} is the served model's name",
                          param="lora_name")  # fmt: skip
    path = inside_roots(body.lora_path, config.lora_dirs) if body.lora_path else None
    if path is None:
        raise bad_request("lora_path must lie under a directory of --lora-dir (links resolved)",
                          param="lora_path")  # fmt: skip
    if is_gguf(path):  # a llama.cpp LoRA file; inside_roots resolved its links
        return body.lora_name, path
    if not os.path.isdir(path):
        raise bad_request(f"lora_path {body.lora_path!r} is not a directory or a GGUF file",
                          param="lora_path")  # fmt: skip
    for name in ADAPTER_FILES:  # why: a link in the directory may lead out of the roots
        if inside_roots(os.path.join(path, name), config.lora_dirs) is None:
            raise bad_request(f"lora_path: {name} leads out of --lora-dir", param="lora_path")
    return body.lora_name, path


async def read_unload(state: FrontendState, req: HttpRequest) -> str:
    """The name an unload asks for."""
    body = decode_body(_unload, await req.body(state.config.max_body_bytes))
    _check_name(body.lora_name)
    return body.lora_name


async def answer(out: Responder, answers: list[LoraAdapters], done: str) -> None:
    """vLLM's plain-text success, or the first core's error as an OpenAI-style one."""
    for a in answers:
        if a.error:
            param = "lora_name" if a.error.startswith("lora_name:") else "lora_path"
            code = "model_not_found" if a.status == 404 else "invalid_lora_adapter"
            raise ApiError(a.status, a.error, param=param, code=code)
    await out.raw(200, f"Success: {done}".encode(), b"text/plain; charset=utf-8")
