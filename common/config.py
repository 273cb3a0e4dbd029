"""The frozen configuration tree, built once from the CLI and sent to every process at spawn."""

from __future__ import annotations

import os
import re
from typing import Annotated, Literal

import msgspec

Device = Literal["cpu", "sim", "cuda"]
DType = Literal["auto", "bfloat16", "float32", "float16"]
CpuWait = Literal["short", "passive", "spin"]
Quantization = Literal["auto", "none", "int8", "int4", "w8a8", "int4-dual"]
SchedulingPolicy = Literal["fair", "priority", "fcfs"]
LogLevel = Literal["debug", "info", "warning", "error"]
LogFormat = Literal["text", "json"]
ToolCallParser = Literal["hermes"]
NOT_A_FLAG = msgspec.Meta(extra={"flag": False})  # a field `gapless serve` has no flag for

# a request's priority: lower runs sooner (vLLM's convention); names are aliases
PRIORITY_NAMES = {"interactive": -10, "default": 0, "batch": 10}
MIN_PRIORITY, MAX_PRIORITY = -1000, 1000
MAX_TENANT_CHARS = 256
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")  # Unicode category Cc


def priority_value(value: int | str) -> int:
    """The integer of a priority given as an integer or a name; ValueError says what is allowed."""
    if isinstance(value, str) and value in PRIORITY_NAMES:
        return PRIORITY_NAMES[value]
    if isinstance(value, int) and MIN_PRIORITY <= value <= MAX_PRIORITY:
        return value
    names = ", ".join(PRIORITY_NAMES)
    raise ValueError(
        f"must be an integer from {MIN_PRIORITY} to {MAX_PRIORITY} or one of {names}; got {value!r}"
    )


def check_tenant_name(name: str) -> None:
    """ValueError unless name can be a tenant: short, without control characters."""
    if len(name) > MAX_TENANT_CHARS:
        raise ValueError(f"is longer than {MAX_TENANT_CHARS} characters")
    if _CONTROL.search(name):
        raise ValueError("holds a control character")


class ModelInfo(msgspec.Struct, frozen=True, kw_only=True):
    """Facts about the model, read from its metadata (no weights) before any process starts."""

    path: str  # a Hugging Face directory or a .gguf file
    architecture: str  # the decoder family (common/families): "llama", "gemma2", ...
    vocab_size: int
    max_model_len: int  # context length the engine enforces
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None = None
    add_bos_token: bool = False
    chat_template: str | None = None
    tokenizer: str | None = None  # a directory with tokenizer.json, when not the model's own
    # keys each query sees, its own included, when every layer slides (ModelArch.kv_window):
    # the core frees the KV blocks behind it; 0: some layer attends to the whole context
    kv_window: int = 0
    # generation_config.json's sampling values (temperature, top_p, top_k, min_p,
    # repetition_penalty): the defaults of a request that leaves the field out
    sampling_defaults: dict[str, float] = {}


class TenantSpec(msgspec.Struct, frozen=True, kw_only=True):
    """What the operator set for one tenant (--api-keys-file, --tenant-weight)."""

    weight: float = 1.0  # its fair share relative to other tenants' weights; > 0
    priority: int = 0  # of its requests that send none
    max_queued_requests: int | None = None  # cap on its waiting requests (429 at the frontend)
    # its prompts' KV goes to the one prefix-cache pool that every sharing tenant reads, so each
    # of them can learn what the others sent (by cached_tokens or timing)
    share_prefix_cache: bool = False
    lora_adapters: tuple[str, ...] = ()  # the LoRA adapters it may name (with a keys file)


class EngineConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Everything a gapless process needs; nobody mutates it after spawn.

    Every field is a `gapless serve` flag unless marked NOT_A_FLAG; launch/cli.py generates
    them: `--field-name`, or `--no-field-name` for a bool that defaults to True, the description
    is the help. Meta(extra=...) keys: flag (the flag's name without `--`), aliases (other
    names of the flag, without `--`), off (the help of a
    `--no-` flag: what turning the default off does), metavar, parse,
    choices and default (hooks cli.py resolves by name, so this shared module imports no role),
    env (the default comes from this environment variable).
    """

    model: Annotated[ModelInfo, NOT_A_FLAG]
    served_model_name: Annotated[str, NOT_A_FLAG]  # cli.py names it from --model
    device: Annotated[Device, msgspec.Meta(description="where the model runs")] = "cpu"
    dtype: Annotated[
        DType,
        msgspec.Meta(
            description="dtype of weights and activations; auto: bfloat16 on cuda, and on a CPU "
            "that computes bfloat16 natively (AVX-512 BF16, AMX, Arm BF16), else float32"
        ),
    ] = "auto"
    quantization: Annotated[
        Quantization,
        msgspec.Meta(
            description="quantized linear layers on cpu: int8 = weight-only, one scale per "
            "output row; int4 = weight-only, groups of 32 with a scale and an offset, which "
            "holds a Q4_1 GGUF's weights exactly; w8a8 = int8 x int8 products (fbgemm; x86), "
            "the activations quantized per row at each call; int4-dual = int4 for steps of up "
            "to 16 rows and the --dtype weights above (both held); none = --dtype weights; "
            "auto: w8a8 (int8 without fbgemm) on a cpu where --dtype auto serves float32 (no "
            "bfloat16 instructions), int4-dual where it serves bfloat16 and the file is a Q4_1 "
            "GGUF, else none"
        ),
    ] = "auto"
    # scheduling
    # scheduling; DEVICE_DEFAULTS gives some of these another default on a GPU
    max_num_seqs: Annotated[int, msgspec.Meta(description="requests running at once", ge=1)] = 64
    max_num_batched_tokens: Annotated[
        int, msgspec.Meta(description="token budget per step", ge=1)
    ] = 512
    block_size: Annotated[int, msgspec.Meta(description="tokens per KV block", ge=1)] = 16
    kv_cache_memory: Annotated[
        Annotated[int, msgspec.Meta(ge=1)] | None,
        msgspec.Meta(
            description="KV cache size, K and V of all layers (default: 512MiB on cpu; on "
            "cuda, what --gpu-memory-utilization leaves)",
            extra={"parse": "bytes"},
        ),
    ] = None  # bytes
    gpu_memory_utilization: Annotated[
        float,
        msgspec.Meta(
            description="share of the GPU's memory the cuda device takes: the weights, the "
            "largest step's activations and CUDA graphs, measured at start, and the KV cache "
            "in what is left (unless --kv-cache-memory sizes it)",
            gt=0,
            le=1,
        ),
    ] = 0.9
    overlap: Annotated[
        bool,
        msgspec.Meta(
            description="schedule the next step while the device runs this one "
            "(off: one step at a time, for A/B runs)",
            extra={
                "off": "run one step at a time instead of planning the next while the device "
                "runs this one (for A/B runs)"
            },
        ),
    ] = True
    speculative: Annotated[
        Literal["off", "ngram", "suffix", "draft"],
        msgspec.Meta(
            description="speculative decoding: ngram drafts each decoding request's next "
            "tokens from its own prompt and output (prompt lookup) and verifies them in one "
            "step, output unchanged; suffix also from its tenant's recent requests (never "
            "another tenant's); draft from --speculative-model, run beside the model (cpu "
            "only); a request's `prediction` drafts whatever this says"
        ),
    ] = "off"
    speculative_model: Annotated[
        str | None,
        msgspec.Meta(
            description="the draft model of --speculative draft: a Hugging Face directory, "
            "Hub id or .gguf file of a family gapless serves, with the model's vocabulary",
            extra={"metavar": "PATH"},
        ),
    ] = None
    # --speculative-model resolved at start (launch/speculative_config.py)
    draft_model: Annotated[ModelInfo | None, NOT_A_FLAG] = None
    num_speculative_tokens: Annotated[
        int,
        msgspec.Meta(
            description="drafted tokens a decoding request verifies per step (--speculative "
            "and `prediction`); 0 turns speculation off, `prediction` included",
            ge=0,
            le=16,
        ),
    ] = 4
    deep_plan_ms: Annotated[
        float,
        msgspec.Meta(
            description="while the device's steps take less than this many ms (a moving "
            "average), plan three steps ahead of the results instead of two, so a host stall "
            "shorter than two steps costs the device nothing; 0: always two",
            ge=0,
        ),
    ] = 4.0
    prefix_caching: Annotated[
        bool,
        msgspec.Meta(
            description="reuse the KV of prompt prefixes already computed (full blocks, by "
            "chained hash; unreferenced ones are evicted least recently used)",
            extra={"off": "compute every prompt token, even of a prefix computed before"},
        ),
    ] = True
    shared_prefix_cache: Annotated[
        bool,
        msgspec.Meta(
            description="one prefix cache for all tenants instead of one per tenant: a tenant "
            "can then learn what another sent (cached_tokens, time to first token)"
        ),
    ] = False
    kv_events_endpoint: Annotated[
        str | None,
        msgspec.Meta(
            description="publish KV cache events (vLLM 0.33's format, for prefix-aware "
            "routers) on a ZMQ PUB socket bound here: tcp://HOST:PORT, or PORT alone for "
            "127.0.0.1 (events carry prompt token ids: keep them on the operator's network); "
            "replica k binds PORT + k; unset: no events",
            extra={"metavar": "ADDR"},
        ),
    ] = None
    kv_events_replay_endpoint: Annotated[
        str | None,
        msgspec.Meta(
            description="a ZMQ ROUTER socket bound here (same forms, PORT + k for replica k) "
            "answers a subscriber's 8-byte big-endian sequence number with the batches from "
            "it on that it still keeps",
            extra={"metavar": "ADDR"},
        ),
    ] = None
    kv_events_topic: Annotated[
        str | None,
        msgspec.Meta(
            description="ZMQ topic (first frame) of every KV event batch; unset: empty",
            extra={"metavar": "TOPIC"},
        ),
    ] = None
    kv_events_queue: Annotated[int, NOT_A_FLAG] = 1024  # batches waiting for the publisher
    kv_events_buffer: Annotated[int, NOT_A_FLAG] = 10_000  # batches kept for replay
    scheduling_policy: Annotated[
        SchedulingPolicy,
        msgspec.Meta(
            description="which waiting request runs next: fair = per-tenant fair share within "
            "priority classes; priority = strict priority, first come first served within a "
            "class; fcfs = arrival order"
        ),
    ] = "fair"
    fair_output_weight: Annotated[
        float,
        msgspec.Meta(
            description="an output token costs this many prompt tokens of a tenant's fair share",
            ge=0,
        ),
    ] = 2.0
    priority_aging_s: Annotated[
        float,
        msgspec.Meta(
            description="seconds after which a waiting request is admitted before any newer "
            "one, whatever its priority or tenant: the bound on starvation",
            gt=0,
            extra={"flag": "priority-aging"},
        ),
    ] = 30.0
    stall_timeout_s: Annotated[
        float,
        msgspec.Meta(
            description='answer /health with 503 "stalled" once the runner (or any '
            "tensor-parallel rank) owes a step's result for this many seconds, or 8 times the "
            "slowest of the last 64 steps if that is longer, while requests wait on it",
            gt=0,
            extra={"flag": "stall-timeout", "metavar": "S"},
        ),
    ] = 5.0
    max_queue_wait_s: Annotated[
        float | None,
        msgspec.Meta(
            description="end a request that has waited this many seconds for its first step "
            "with an error (HTTP 429 when not streaming) instead of letting it wait on",
            extra={"flag": "max-queue-wait", "metavar": "S"},
        ),
    ] = None
    # admission at the frontends (README, "Admission control"); "queued" counts engine
    # requests (each of n choices) sent to the core that have not started, over every frontend
    max_queued_requests: Annotated[
        Annotated[int, msgspec.Meta(ge=1)] | None,
        msgspec.Meta(
            description="answer 429 to a request that would make more than this many requests "
            "wait for a seat (each of n choices counts), before tokenizing it",
            extra={"metavar": "N"},
        ),
    ] = None
    max_queued_tokens: Annotated[
        Annotated[int, msgspec.Meta(ge=1)] | None,
        msgspec.Meta(
            description="answer 429 to a request whose prompt tokens (times n) would make the "
            "waiting requests' prompt tokens more than this",
            extra={"metavar": "TOKENS"},
        ),
    ] = None
    # runner
    tensor_parallel_size: Annotated[
        int,
        msgspec.Meta(
            description="runner processes the model is split over, one torch.distributed "
            "rank each (gloo on cpu; NCCL on cuda, rank r on GPU r): attention heads, MLP rows "
            "and the vocabulary split among them, each holding its share of the weights and "
            "of the KV cache; on sim, the profile's timing at this many GPUs",
            ge=1,
            extra={"aliases": ("tp",), "metavar": "N"},
        ),
    ] = 1
    data_parallel_size: Annotated[
        int,
        msgspec.Meta(
            description="engine replicas on this host, each a core, a detokenizer and its "
            "runner(s) (--tensor-parallel-size of them) with a copy of the model and its own KV "
            "cache, behind the same frontends; a request goes to the replica with the fewest "
            "tokens to compute before it (prompt tokens waiting there, less the prefix of its "
            "prompt the replica holds); on cuda, replica k's ranks use the GPUs after replica "
            "k-1's",
            ge=1,
            le=64,
            extra={"aliases": ("dp",), "metavar": "M"},
        ),
    ] = 1
    replica: Annotated[int, NOT_A_FLAG] = 0  # which replica an engine process belongs to
    dist_timeout_s: Annotated[
        float,
        msgspec.Meta(
            description="seconds a tensor-parallel rank waits for the others to join, and for "
            "any collective, before it fails",
            gt=0,
            extra={"flag": "dist-timeout", "metavar": "S"},
        ),
    ] = 120.0
    nnodes: Annotated[
        int,
        msgspec.Meta(
            description="hosts the tensor-parallel ranks are spread over, "
            "--tensor-parallel-size / N ranks each; host 0 runs the server and rank 0, the "
            "others `gapless serve --headless`",
            ge=1,
            extra={"metavar": "N"},
        ),
    ] = 1
    node_rank: Annotated[
        int, msgspec.Meta(description="this host's number among --nnodes, 0 first", ge=0)
    ] = 0
    master_addr: Annotated[
        str,
        msgspec.Meta(
            description="address of host 0, where the ranks meet (torch.distributed's TCP "
            "store) and read the plans",
            extra={"metavar": "ADDR"},
        ),
    ] = "127.0.0.1"
    master_port: Annotated[
        int,
        msgspec.Meta(
            description="port of the ranks' TCP store on host 0; the plans go out on the next "
            "port (0: a free port, one host only)",
            ge=0,
            le=65534,
            extra={"metavar": "PORT"},
        ),
    ] = 0
    headless: Annotated[
        bool,
        msgspec.Meta(
            description="run only this host's tensor-parallel ranks (--node-rank above 0), "
            "no server: they join host 0's at --master-addr"
        ),
    ] = False
    threads: Annotated[
        int,
        msgspec.Meta(
            description="torch intra-op threads on the cpu device",
            ge=1,
            extra={"default": "all_cores"},
        ),
    ] = 1
    cpu_wait: Annotated[
        CpuWait,
        msgspec.Meta(
            description="how the cpu device's idle torch threads wait for work: short spins "
            "a few microseconds, then sleeps (fastest on an idle machine, half the loss of spin "
            "on a busy one); passive sleeps at once (best when other programs keep the cores "
            "busy, slower when idle); spin is the OpenMP runtime's default"
        ),
    ] = "short"
    seed: Annotated[int, msgspec.Meta(description="seed of unseeded sampling")] = 0
    sim_profile: Annotated[
        str,
        msgspec.Meta(
            description="timing profile of --device sim (docs/sim-profiles.md); the KV capacity "
            "comes from the profile, --model gives the tokenizer and context length",
            extra={"choices": "sim_profiles"},
        ),
    ] = "h100-llama3-8b"
    sim_time_scale: Annotated[
        float,
        msgspec.Meta(
            description="multiply every modelled step time of --device sim by this (e.g. 0.5 "
            "for a device twice as fast), to find the shortest step the host keeps fed",
            gt=0,
            le=100,
        ),
    ] = 1.0
    cuda_graph: Annotated[
        bool,
        msgspec.Meta(
            description="replay cuda decode steps as captured graphs (off: run them eagerly)",
            extra={"off": "run cuda decode steps eagerly instead of replaying captured graphs"},
        ),
    ] = True
    compile: Annotated[
        bool,
        msgspec.Meta(
            description="compile the cpu device's decode step with torch.compile at start "
            "(cached on disk under the cache directory)",
            extra={"off": "run cpu decode steps eagerly instead of compiling them at start"},
        ),
    ] = True
    attention_kernel: Annotated[
        bool,
        msgspec.Meta(
            description="cpu decode attention through gapless's paged kernel, built with the "
            "machine's C++ compiler at first use (cached under the cache directory); without "
            "a compiler, torch's",
            extra={"off": "cpu decode attention through torch (a gathered copy, then SDPA)"},
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
    admin_api_key: Annotated[
        str | None,
        msgspec.Meta(
            description="a key that may also read /v1/engine/* and every tenant's /metrics "
            "series (a tenant's key reads only its own)",
            extra={"env": "GAPLESS_ADMIN_API_KEY"},
        ),
    ] = None
    api_servers: Annotated[
        int, msgspec.Meta(description="frontend processes sharing the port", ge=1)
    ] = 1
    metrics_require_key: Annotated[
        bool,
        msgspec.Meta(
            description="/metrics needs an API key like every route but /health (open, it "
            "shows every tenant's name and traffic); a tenant's key then reads only that "
            "tenant's series, the admin key all of them"
        ),
    ] = False
    max_n: Annotated[int, msgspec.Meta(description="most choices (n) one request may ask for")] = 8
    max_logprobs: Annotated[
        int, msgspec.Meta(description="most alternative logprobs per token a request may ask for")
    ] = 20
    stream_buffer_events: Annotated[
        int,
        msgspec.Meta(
            description="events a stream's client may leave unread (sent, not taken off the "
            "socket) before its request is aborted as a slow reader (its KV freed)",
            ge=1,
            extra={"metavar": "N"},
        ),
    ] = 1024
    stream_write_timeout_s: Annotated[
        float,
        msgspec.Meta(
            description="seconds a stream's client may take none of the bytes sent to it "
            "before the request is aborted as a slow reader",
            gt=0,
            extra={"flag": "stream-write-timeout", "metavar": "S"},
        ),
    ] = 30.0
    sse_keepalive_s: Annotated[
        float,
        msgspec.Meta(
            description="send an SSE comment after this many seconds without an event, so "
            "proxies keep a waiting stream open (0: never)",
            ge=0,
            extra={"flag": "sse-keepalive", "metavar": "S"},
        ),
    ] = 15.0
    max_prompts: Annotated[
        int,
        msgspec.Meta(description="most prompts one /v1/completions request may batch", ge=1),
    ] = 64
    tool_call_parser: Annotated[
        ToolCallParser,
        msgspec.Meta(
            description="how tool calls are read from generated text (tool_choice auto); "
            "hermes = <tool_call>{...}</tool_call>"
        ),
    ] = "hermes"
    grammar_workers: Annotated[
        int,
        msgspec.Meta(
            description="processes per frontend that compile response_format and tool schemas "
            "(compiles at once; a tenant gets at most half of them, and a tenant with none "
            "running may stop another's long compile)",
            ge=1,
            extra={"metavar": "N"},
        ),
    ] = 2
    grammar_memory: Annotated[
        int,
        msgspec.Meta(
            description="memory one schema's compile may take; past it the compile ends with a 400",
            ge=1,
            extra={"parse": "bytes"},
        ),
    ] = 256 * 2**20  # bytes, on top of what an idle compile worker holds
    grammar_timeout_s: Annotated[float, NOT_A_FLAG] = 5.0  # a compile's deadline, and its wait
    chat_template: Annotated[
        str | None,
        msgspec.Meta(
            description="a jinja chat template file used instead of the model's",
            extra={"metavar": "FILE"},
        ),
    ] = None
    # connections (README, "Connections"): a head's and a body's bounds are Apache
    # mod_reqtimeout's defaults
    header_timeout_s: Annotated[
        float,
        msgspec.Meta(
            description="seconds a new connection has to send a whole request head, and a "
            "keep-alive connection from the first byte of its next one; past it the connection "
            "is closed (408 if part of a head came)",
            gt=0,
            extra={"flag": "header-timeout", "metavar": "S"},
        ),
    ] = 20.0
    body_timeout_s: Annotated[
        float,
        msgspec.Meta(
            description="seconds a request body may take after its head, plus one second for "
            "every --body-min-rate bytes received; past it a 408 and the connection is closed",
            gt=0,
            extra={"flag": "body-timeout", "metavar": "S"},
        ),
    ] = 20.0
    body_min_rate: Annotated[
        int,
        msgspec.Meta(
            description="bytes per second a request body must keep up, once --body-timeout "
            "has passed",
            ge=1,
            extra={"metavar": "BYTES"},
        ),
    ] = 500
    keep_alive_timeout_s: Annotated[
        float,
        msgspec.Meta(
            description="seconds an idle keep-alive connection stays open after its last "
            "response: longer than clients keep one for reuse (httpx and the openai client 5 s, "
            "aiohttp 15 s, Go 90 s), so that no client sends a request on a connection the "
            "server is closing",
            gt=0,
            extra={"flag": "keep-alive-timeout", "metavar": "S"},
        ),
    ] = 120.0
    max_connections: Annotated[
        Annotated[int, msgspec.Meta(ge=1)] | None,
        msgspec.Meta(
            description="open connections per frontend; past it the longest-idle keep-alive "
            "connection is closed for a new one, or, with none idle, a new connection may ask "
            "/health, /live or /metrics and gets 503 for anything else; unset: half the process's "
            "file descriptor limit",
            extra={"metavar": "N"},
        ),
    ] = None
    max_body_bytes: Annotated[int, NOT_A_FLAG] = 4 * 2**20
    max_head_bytes: Annotated[int, NOT_A_FLAG] = 64 * 2**10  # request line + headers; 431 past it
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
    log_level: Annotated[
        LogLevel, msgspec.Meta(description="the least severe log lines every process writes")
    ] = "info"
    log_format: Annotated[
        LogFormat,
        msgspec.Meta(description="text: one readable line per record; json: one JSON object"),
    ] = "text"
    stats_interval_s: Annotated[
        float,
        msgspec.Meta(
            description="while requests run, the core logs a stats line this often (0: never)",
            ge=0,
            extra={"flag": "stats-interval", "metavar": "S"},
        ),
    ] = 10.0
    # how long /health says 503 before serve exits
    dead_engine_grace_s: Annotated[float, NOT_A_FLAG] = 3.0
    # tenants (cli.py adds --tenant-weight NAME=W, which sets TenantSpec.weight)
    api_keys_file: Annotated[
        str | None,
        msgspec.Meta(
            description='JSON object of API keys: {"KEY": "TENANT"} or {"KEY": {"tenant": ..., '
            '"weight": ..., "priority": ..., "max_queued_requests": ..., "share_prefix_cache": '
            'true, "admin": true}}; a request needs one of them (or --api-key) and its tenant '
            "is its key's",
            extra={"metavar": "FILE"},
        ),
    ] = None
    api_keys: Annotated[dict[str, str], NOT_A_FLAG] = {}  # key -> tenant, from api_keys_file
    admin_keys: Annotated[tuple[str, ...], NOT_A_FLAG] = ()  # those of api_keys marked admin
    # every tenant the keys file or --tenant-weight names; any other weighs 1, priority 0
    tenants: Annotated[dict[str, TenantSpec], NOT_A_FLAG] = {}
    # stored responses (/v1/responses; docs/responses.md)
    responses_store: Annotated[
        str | None,
        msgspec.Meta(
            description="the SQLite file /v1/responses keeps stored responses in, shared by "
            "every frontend and replica of the host and kept across restarts; left out, "
            "responses.sqlite in the model cache (~/.cache/gapless); a postgresql:// URL keeps "
            "them in PostgreSQL (the postgres extra); none keeps nothing",
            extra={"metavar": "PATH"},
        ),
    ] = None
    responses_store_days: Annotated[
        float,
        msgspec.Meta(
            description="stored responses older than this many days are deleted",
            gt=0,
            extra={"metavar": "DAYS"},
        ),
    ] = 30.0
    responses_store_bytes: Annotated[
        int,
        msgspec.Meta(
            description="past this size the oldest stored responses are deleted first",
            ge=1,
            extra={"parse": "bytes"},
        ),
    ] = 2**30
    # LoRA adapters (docs/lora.md); vLLM's flag names
    enable_lora: Annotated[
        bool, msgspec.Meta(description="serve LoRA adapters (implied by --lora-modules)")
    ] = False
    lora_modules: Annotated[dict[str, str], NOT_A_FLAG] = {}  # name -> peft directory
    max_loras: Annotated[
        int, msgspec.Meta(description="LoRA adapters resident at once (at least those of "
                          "--lora-modules)", ge=1)
    ] = 1  # fmt: skip
    max_lora_rank: Annotated[
        int, msgspec.Meta(description="highest rank of an adapter's projection", ge=1, le=256)
    ] = 16
    # roots POST /v1/load_lora_adapter may read adapters from (--lora-dir); empty: no loading
    lora_dirs: Annotated[tuple[str, ...], NOT_A_FLAG] = ()
    max_cpu_loras: Annotated[
        Annotated[int, msgspec.Meta(ge=1)] | None,
        msgspec.Meta(description="LoRA adapters kept in host memory, least recently used out "
                     "and read again when asked (default: every loaded one)"),
    ] = None  # fmt: skip

    @property
    def num_ranks(self) -> int:
        """Runner processes: one per tensor-parallel rank; one on sim, whose profile models
        the ranks' timing instead."""
        return 1 if self.device == "sim" else self.tensor_parallel_size

    @property
    def tenant_weights(self) -> dict[str, float]:
        """tenant -> weight of every tenant in `tenants`; any other weighs 1."""
        return {name: spec.weight for name, spec in self.tenants.items()}

    def ipc(self, name: str) -> str:
        """ZMQ address of one named socket inside the run directory."""
        return "ipc://" + os.path.join(self.run_dir, name)

    def engine_ipc(self, name: str, replica: int | None = None) -> str:
        """ZMQ address of one of a replica's engine sockets (this process's replica when left
        out): replica 0's keep their plain names, replica k's end in `.k`."""
        k = self.replica if replica is None else replica
        return self.ipc(name if k == 0 else f"{name}.{k}")

    def role_name(self, role: str) -> str:
        """How the supervisor and logs name an engine process of this replica: `core`,
        `gpu_runner1` (rank 1) for replica 0, `core.2` for replica 2."""
        return role if self.replica == 0 else f"{role}.{self.replica}"


def encode_config(config: EngineConfig) -> str:
    return msgspec.json.encode(config).decode()


def decode_config(text: str | bytes) -> EngineConfig:
    return msgspec.json.decode(text, type=EngineConfig)


CPU_KV_CACHE_MEMORY = 512 * 2**20  # bytes: --kv-cache-memory's default on cpu
# flag defaults that differ by --device (`gapless serve` resolves them; a config built in code
# takes the field's default): a GPU step of 8192 tokens over 256 sequences keeps it busy where
# the cpu's 512 over 64 would leave most of it idle
DEVICE_DEFAULTS: dict[str, dict[str, int]] = {
    "cuda": {"max_num_seqs": 256, "max_num_batched_tokens": 8192},
}


def max_useful_blocks(max_num_seqs: int, max_model_len: int, block_size: int) -> int:
    """KV blocks beyond which a cache cannot be used: max_num_seqs full contexts, plus the
    reserved block 0. Every device caps its capacity here."""
    return max_num_seqs * -(-max_model_len // block_size) + 1


def max_seq_blocks(max_model_len: int, block_size: int, num_blocks: int) -> int:
    """KV blocks one sequence can hold: its context's, and never more than a cache of
    num_blocks (the reserved block 0 included) has, whatever context the model declares.
    Everything sized per sequence (the runner's block tables, the core's output ids) is sized
    by this, so a 10^9-token context costs what the cache holds."""
    return max(1, min(-(-max_model_len // block_size), num_blocks - 1))


CONFIG_ENV = "GAPLESS_CONFIG"
