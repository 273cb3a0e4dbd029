"""The frozen configuration tree, built once from the CLI and sent to every process at spawn."""

from __future__ import annotations

import os
from typing import Literal

import msgspec

Device = Literal["cpu", "sim", "cuda"]
DType = Literal["bfloat16", "float32", "float16"]


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
    """Everything a gapless process needs; nobody mutates it after spawn."""

    model: ModelInfo
    served_model_name: str
    device: Device = "cpu"
    dtype: DType = "bfloat16"
    # scheduling
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    block_size: int = 16
    kv_cache_memory: int = 512 * 2**20  # bytes for K and V of all layers
    overlap: bool = True
    # runner
    threads: int = 1  # torch intra-op threads on the cpu device
    seed: int = 0
    sim_profile: str = "h100-llama3-8b"
    cuda_graph: bool = True
    trace_file: str | None = None
    # frontend
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    api_servers: int = 1
    max_n: int = 8
    max_logprobs: int = 20
    max_body_bytes: int = 4 * 2**20
    max_stop_strings: int = 16
    chat_template_timeout_s: float = 2.0
    # lifecycle
    run_dir: str = ""  # private 0700 directory holding the ipc sockets
    drain_timeout_s: float = 30.0
    dead_engine_grace_s: float = 3.0  # how long /health says 503 before serve exits

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
