"""The frozen configuration tree, built once from the CLI and sent to every process at spawn."""

from __future__ import annotations

import os
from typing import Annotated, Literal

import msgspec

Device = Literal["cpu", "sim", "cuda"]
DType = Literal["bfloat16", "float32", "float16"]
NOT_A_FLAG = msgspec.Meta(extra={"flag": False})  # a field `gapless serve` has no flag for


class ModelInfo(msgspec.Struct, frozen=True, kw_only=True):
    """Facts about the model, read from its metadata (no weights) before any process starts."""

    path: str  # a Hugging Face directory or a .gguf file
    architecture: str  # "llama" or "qwen2"
    vocab_size: int
    max_model_len: int  # context length the engine enforces
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None = None
    add_bos_token: bool = False
    chat_template: str | None = None


class EngineConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Everything a gapless process needs; nobody mutates it after spawn.

    Every field is a `gapless serve` flag unless marked NOT_A_FLAG; core/launch/cli.py generates
    them: `--field-name`, or `--no-field-name` for a bool that defaults to True, the description
    is the help. Meta(extra=...) keys: flag (the flag's name without `--`), parse, choices and
    default (hooks cli.py resolves by name, so this shared module imports no role), env (the
    default comes from this environment variable).
    """

    model: Annotated[ModelInfo, NOT_A_FLAG]
    served_model_name: Annotated[str, NOT_A_FLAG]  # cli.py names it from --model
    device: Annotated[Device, msgspec.Meta(description="where the model runs")] = "cpu"
    dtype: Annotated[DType, msgspec.Meta(description="dtype of weights and activations")] = (
        "bfloat16"
    )
    # scheduling
    max_num_seqs: Annotated[int, msgspec.Meta(description="requests running at once", ge=1)] = 64
    max_num_batched_tokens: Annotated[
        int, msgspec.Meta(description="token budget per step", ge=1)
    ] = 512
    block_size: Annotated[int, msgspec.Meta(description="tokens per KV block", ge=1)] = 16
    kv_cache_memory: Annotated[
        int,
        msgspec.Meta(description="KV cache size, K and V of all layers", extra={"parse": "bytes"}),
    ] = 512 * 2**20  # bytes
    overlap: Annotated[
        bool,
        msgspec.Meta(
            description="schedule the next step while the device runs this one "
            "(off: one step at a time, for A/B runs)"
        ),
    ] = True
    # runner
    threads: Annotated[
        int,
        msgspec.Meta(
            description="torch intra-op threads on the cpu device",
            ge=1,
            extra={"default": "all_cores"},
        ),
    ] = 1
    seed: Annotated[int, msgspec.Meta(description="seed of unseeded sampling")] = 0
    sim_profile: Annotated[
        str,
        msgspec.Meta(
            description="timing profile of --device sim (docs/sim-profiles.md); the KV capacity "
            "comes from the profile, --model gives the tokenizer and context length",
            extra={"choices": "sim_profiles"},
        ),
    ] = "h100-llama3-8b"
    cuda_graph: Annotated[
        bool,
        msgspec.Meta(
            description="replay cuda decode steps as captured graphs (off: run them eagerly)"
        ),
    ] = True
    trace_file: Annotated[
        str | None, msgspec.Meta(description="write the device timeline as a Chrome trace here")
    ] = None
    # frontend
    host: Annotated[str, msgspec.Meta(description="address the HTTP server binds")] = "127.0.0.1"
    port: Annotated[int, msgspec.Meta(description="port the HTTP server listens on")] = 8000
    api_key: Annotated[
        str | None,
        msgspec.Meta(
            description="required as 'Authorization: Bearer KEY'",
            extra={"env": "GAPLESS_API_KEY"},
        ),
    ] = None
    api_servers: Annotated[
        int, msgspec.Meta(description="frontend processes sharing the port", ge=1)
    ] = 1
    max_n: Annotated[int, msgspec.Meta(description="most choices (n) one request may ask for")] = 8
    max_logprobs: Annotated[
        int, msgspec.Meta(description="most alternative logprobs per token a request may ask for")
    ] = 20
    max_body_bytes: Annotated[int, NOT_A_FLAG] = 4 * 2**20
    max_stop_strings: Annotated[int, NOT_A_FLAG] = 16
    chat_template_timeout_s: Annotated[float, NOT_A_FLAG] = 2.0
    # lifecycle
    run_dir: Annotated[str, NOT_A_FLAG] = ""  # private 0700 directory holding the ipc sockets
    drain_timeout_s: Annotated[
        float,
        msgspec.Meta(
            description="seconds SIGTERM waits for in-flight requests",
            extra={"flag": "drain-timeout"},
        ),
    ] = 30.0
    # how long /health says 503 before serve exits
    dead_engine_grace_s: Annotated[float, NOT_A_FLAG] = 3.0

    def ipc(self, name: str) -> str:
        """ZMQ address of one named socket inside the run directory."""
        return "ipc://" + os.path.join(self.run_dir, name)


def encode_config(config: EngineConfig) -> str:
    return msgspec.json.encode(config).decode()


def decode_config(text: str | bytes) -> EngineConfig:
    return msgspec.json.decode(text, type=EngineConfig)


def max_useful_blocks(max_num_seqs: int, max_model_len: int, block_size: int) -> int:
    """KV blocks beyond which a cache cannot be used: max_num_seqs full contexts, plus the
    reserved block 0. Every device caps its capacity here."""
    return max_num_seqs * -(-max_model_len // block_size) + 1


CONFIG_ENV = "GAPLESS_CONFIG"
