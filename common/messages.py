"""Every message that crosses a process boundary, one tagged union per channel.

All are msgspec Structs encoded with msgpack; nothing on any socket is ever pickled.
Channels (each a ZMQ PUSH -> PULL pair over ipc:// in the run directory):

  frontend, detokenizer -> core      CoreInput
  core -> gpu_runner                 RunnerInput
  gpu_runner -> core                 RunnerOutput
  core -> detokenizer                DetokInput
  detokenizer, supervisor -> frontend FrontendInput
  every process -> supervisor        ControlMessage
"""

from __future__ import annotations

from typing import Literal

import msgspec

FinishReason = Literal["stop", "length", "abort", "error"]  # what a client sees
# How a request ended, as the core tells the detokenizer (docs/architecture.md, "A request's end"):
# "stop_token": the last id is EOS or a stop token id; its text is withheld unless
# include_stop_str_in_output. "queue_timeout": it waited longer than --max-queue-wait for its
# first step (the client sees an error with code queue_timeout: HTTP 429 when not streaming).
# A stop string is found by the detokenizer, never sent here.
EndReason = Literal["stop_token", "length", "abort", "error", "queue_timeout"]


class _Msg(msgspec.Struct, tag=True, array_like=True, omit_defaults=True, gc=False):
    pass


class SamplingParams(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, frozen=True):
    """Per-request generation settings, validated by the frontend before they get here."""

    max_tokens: int
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 disables
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None  # None: none; 0: sampled token only; k: also the top k
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    min_tokens: int = 0  # EOS and stop token ids are masked until this many outputs
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    allowed_token_ids: tuple[int, ...] | None = None  # None: every id; else only these
    bad_words_ids: tuple[tuple[int, ...], ...] = ()  # token sequences never completed
    # None: none; k: each prompt token after the first with its logprob and the top k
    prompt_logprobs: int | None = None
    # an llguidance grammar (the frontend compiles response_format and tool schemas to it and
    # checks it); sampling is limited to what it allows next
    grammar: str | None = None
    # an embedding request (POST /v1/embeddings): the runner pools the final hidden state over
    # the prompt ("last" token, "mean", "cls": the first token) and sends it with the one
    # token it samples; no prefix-cache hit and no KV kept (the frontend sets max_tokens 1)
    pooling: Literal["last", "mean", "cls"] | None = None


# ---------------------------------------------------------------- frontend/detokenizer -> core


class AddRequest(_Msg):
    request_id: str  # unique per engine; the frontend prefixes its id
    frontend_id: int
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float  # time.time() when the HTTP request arrived
    tenant: str = ""
    priority: int = 0  # in [-1000, 1000], lower runs sooner: -10 interactive, 0 default, 10 batch
    label: str = ""  # the client's X-Request-Id (or one made up), for logs; clients reuse ids
    # the prefix-cache scope (block_hash.cache_scope of the tenant's pool and the client's
    # cache_salt): requests hit only blocks computed under the same scope
    cache_salt: str = ""
    # chained hashes of the prompt's full blocks (common/block_hash.py) for this engine's
    # block size, model and cache_salt, computed by the frontend; empty: the core computes them
    block_hashes: list[bytes] = []
    # OpenAI's Predicted Outputs: the predicted text's ids, drafts the runner verifies
    prediction: list[int] = []
    lora: str = ""  # the LoRA adapter the request runs with; "": the base model


class Abort(_Msg):
    request_ids: list[str]


class StreamEnded(_Msg):
    """The detokenizer ended these requests' streams: "stop", a stop string completed; "error",
    detokenizing failed. The core ends them and sends nothing back."""

    request_ids: list[str]
    reason: Literal["stop", "error"]


class Shutdown(_Msg):
    pass


class GetStats(_Msg):
    """Ask the core for a snapshot; it answers with EngineStats to the frontend."""

    frontend_id: int
    token: int


KEEP_STEPS = 8192  # steps the core's timeline keeps; GetTimeline.last is at most this


class GetTimeline(_Msg):
    """Ask the core for its last `last` steps; it answers with Timeline to the frontend."""

    frontend_id: int
    token: int
    last: int


class ResetPrefixCache(_Msg):
    """Ask the core to forget its cached prefixes; it answers with PrefixCacheReset."""

    frontend_id: int
    token: int


class LoadLora(_Msg):
    """POST /v1/load_lora_adapter, its name and path checked by the frontend (docs/lora.md):
    the runner reads the adapter off its step thread; the core answers with LoraAdapters."""

    frontend_id: int
    token: int
    name: str
    path: str


class UnloadLora(_Msg):
    """POST /v1/unload_lora_adapter: the adapter's running requests finish, its waiting ones
    end with an error; the core answers with LoraAdapters."""

    frontend_id: int
    token: int
    name: str


CoreInput = (
    AddRequest
    | Abort
    | StreamEnded
    | Shutdown
    | GetStats
    | GetTimeline
    | ResetPrefixCache
    | LoadLora
    | UnloadLora
)


# ---------------------------------------------------------------- core -> gpu_runner


class NewSlot(_Msg):
    """A request takes a slot of the runner's persistent batch before the plan's step runs."""

    slot: int
    params: SamplingParams
    num_prompt_tokens: int  # positions below this are prompt tokens (penalties treat them apart)
    # ids at the positions the prefix cache already holds (never fed), sent only when the
    # request has penalties: the sampler must count every token of the sequence
    cached_ids: list[int] = []
    prompt_token_ids: list[int] = []  # only with params.prompt_logprobs: the tokens to score
    # speculation: "" none, else the drafter ("ngram", "suffix"; "prediction" drafts from `prediction`);
    # a drafting slot is also sent its cached_ids, which the n-gram lookup reads
    draft_method: str = ""
    prediction: list[int] = []
    # a `suffix` slot's tenant: its drafts come from this tenant's requests, and its tokens
    # join this tenant's history when it leaves; never another tenant's
    tenant: str = ""
    lora: str = ""  # the LoRA adapter its rows run with; "": the base model


class StepPlan(_Msg):
    """One step. Entries are the scheduled slots in order; arrays are flat, indexed by entry.

    A decode entry carries no token id: the runner reads last_token[slot], written by the
    sampler of the step that produced it. Prefill chunks carry their token ids.
    """

    seq: int  # plans run strictly in order: the runner asserts seq == last + 1
    new_slots: list[NewSlot]
    freed_slots: list[int]  # released before this step's inputs are prepared
    slots: list[int]  # [B]
    num_tokens: list[int]  # [B] query tokens of each entry
    start_pos: list[int]  # [B] position of each entry's first query token
    has_tokens: list[bool]  # [B] True: ids for this entry are in token_ids; False: last_token
    token_ids: list[int]  # concatenated ids of entries with has_tokens
    sample: list[bool]  # [B] sample a token after this entry (prompt done or decoding)
    num_new_blocks: list[int]  # [B] KV blocks appended to the slot's block table this step
    new_blocks: list[int]  # concatenated block ids
    # [B] drafted tokens each device-fed decode entry may verify after its last token; empty:
    # none. A count, never ids: the runner owns each slot's drafts and its true length, which
    # runs ahead of start_pos by the drafts accepted in steps the core has not applied yet
    num_draft: list[int] = []


class ReadAdapter(_Msg):
    """Read a LoRA adapter into host memory, on a thread apart from the steps; the runner
    answers AdapterRead. A slot that names it later makes it resident."""

    name: str
    path: str


class DropAdapter(_Msg):
    """Forget an adapter's weights; slots that use it keep them until they are freed."""

    name: str


RunnerInput = StepPlan | Shutdown | ReadAdapter | DropAdapter


# ---------------------------------------------------------------- gpu_runner -> core


class StepTiming(msgspec.Struct, array_like=True, gc=False):
    """Device timeline of one step, seconds on time.perf_counter's clock of the runner."""

    plan_received: float
    launched: float
    device_start: float
    device_end: float
    published: float
    prepare_s: float = 0.0
    forward_s: float = 0.0
    sample_s: float = 0.0


class SampleLogprobs(msgspec.Struct, array_like=True, gc=False):
    """One sampled token's raw model logprob and the top ids asked for, best first."""

    logprob: float
    top_ids: list[int] = []
    top_logprobs: list[float] = []


class PromptLogprobs(msgspec.Struct, array_like=True, gc=False):
    """Logprobs of the prompt tokens at positions start .. start + len(token_ids) - 1, each
    given the tokens before it (position 0 has none). From the runner, one per prompt chunk of a
    slot that asked; the core joins a request's chunks and sends them whole, slot -1."""

    slot: int
    start: int
    token_ids: list[int]
    logprobs: list[SampleLogprobs]


class StepResult(_Msg):
    seq: int
    # one per entry with sample=True, in entry order; with counts, counts[j] for entry j
    token_ids: list[int]
    # same order as token_ids, None for rows that asked none; empty when no row asked
    logprobs: list[SampleLogprobs | None] = []
    timing: StepTiming | None = None
    prompt_logprobs: list[PromptLogprobs] = []  # chunks of slots that asked, in entry order
    # same order as token_ids: the pooled hidden state of a pooling row (SamplingParams.pooling)
    # as little-endian float32 bytes [hidden], b"" for other rows; empty when no row pools
    embeddings: list[bytes] = []
    # [B_s] tokens of each sampled entry (its accepted drafts, then the one sampled after
    # them) and [B_s] drafts it verified; both empty when no entry drafted
    counts: list[int] = []
    num_drafted: list[int] = []


class RunnerReady(_Msg):
    num_kv_blocks: int
    # the device's step time (seconds) at these token counts, for speculation's cost model
    # (core/spec_cost.py): measured at start on cpu, the profile's on sim; empty: none
    step_tokens: list[int] = []
    step_seconds: list[float] = []


class RunnerError(_Msg):
    seq: int
    message: str


class StepRefused(_Msg):
    """The runner's answer to a plan its batch cannot run (gpu_runner/plan_check.py), in the
    place of that step's result: the core ends the step's requests with an error."""

    seq: int
    reason: str


class AdapterRead(_Msg):
    """ReadAdapter's answer: the adapter is in host memory, or why it cannot be served."""

    name: str
    error: str = ""


RunnerOutput = StepResult | RunnerReady | RunnerError | StepRefused | AdapterRead


# ---------------------------------------------------------------- core -> detokenizer


class DetokNew(_Msg):
    request_id: str
    frontend_id: int
    params: SamplingParams
    prompt_tail: list[int]  # last few prompt ids, so the first text decodes in context


class TokenBatch(_Msg):
    """New tokens of one step for several requests, flat and indexed per entry; an entry with
    no token only ends its request (abort, error)."""

    request_ids: list[str]
    counts: list[int]  # tokens per entry (0 for a pure end)
    token_ids: list[int]  # concatenated, entry by entry
    finish_reasons: list[str]  # per entry: "" still running, else an EndReason
    num_prompt_tokens: list[int]
    # per token, aligned with token_ids: its logprobs, None if its request asked none;
    # empty when no request in the batch asked
    logprobs: list[SampleLogprobs | None] = []
    errors: list[str] = []  # per entry, "" unless finish_reason is "error"; empty when none
    # per entry, the prompt tokens its request found in the prefix cache; empty unless an entry
    # ends here (only the last delta of a request reports it)
    num_cached_tokens: list[int] = []
    # per entry: the request's prompt logprobs, sent with its first token; empty when none
    prompt_logprobs: list[PromptLogprobs | None] = []
    # per entry: its pooled vector (StepResult.embeddings), b"" for none; empty when none
    embeddings: list[bytes] = []


DetokInput = DetokNew | TokenBatch | Shutdown


# ---------------------------------------------------------------- detokenizer/supervisor -> frontend


class TopLogprob(msgspec.Struct, array_like=True, gc=False):
    token: str
    logprob: float
    token_id: int


class TokenLogprob(msgspec.Struct, array_like=True, gc=False):
    token: str
    logprob: float
    token_id: int
    top: list[TopLogprob] = []


class TextDelta(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    request_id: str
    text: str
    token_ids: list[int]  # the tokens this text came from
    num_prompt_tokens: int
    num_output_tokens: int  # cumulative
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None
    error: str | None = None
    code: str | None = None  # with error: "queue_timeout" (the client's load), else an engine fault
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache; set on the last delta
    prompt_logprobs: list[TokenLogprob] | None = None  # prompt tokens after the first; first delta
    # an embedding request's pooled vector, little-endian float32 [hidden]; on its last delta
    embedding: bytes | None = None


class TextDeltas(_Msg):
    deltas: list[TextDelta]


class EngineDead(_Msg):
    reason: str


class Heartbeat(_Msg):
    """The core's busy loop is turning: sent to every frontend every HEARTBEAT_INTERVAL_S.
    A frontend that hears none for HEARTBEAT_TIMEOUT_S answers /health with 503, and so does
    one whose last heartbeat says the runner is stalled (core/stall.py)."""

    replica: int = 0  # whose core (--data-parallel-size)
    stalled_s: float = 0.0  # how long a step's result has been owed, once past the stall bound
    usual_s: float = 0.0  # the slowest of the recent steps' results, for the message


HEARTBEAT_INTERVAL_S = 0.5
HEARTBEAT_TIMEOUT_S = 3.0


class EngineStats(_Msg):
    token: int
    num_running: int
    num_waiting: int
    num_free_blocks: int  # empty blocks and cached blocks no request holds
    num_total_blocks: int
    # prefix cache
    num_cached_blocks: int = 0  # blocks holding KV under a hash, held or not
    num_cached_free_blocks: int = 0  # of which no request holds (evicted when needed)
    prefix_queried_tokens: int = 0  # tokens looked up at admissions, since start
    prefix_hit_tokens: int = 0  # of which found cached
    prefix_evictions: int = 0  # cached blocks reused for other content, since start


class PrefixCacheReset(_Msg):
    token: int
    done: bool  # False while a request holds KV blocks (nothing changed)


class StepRecord(msgspec.Struct, omit_defaults=True, gc=False):
    """One step of the device timeline. Times are seconds on time.perf_counter's clock, which
    is CLOCK_MONOTONIC and so shared by every process of the engine."""

    seq: int
    plan_sent: float  # core
    plan_received: float  # runner
    launched: float
    device_start: float
    device_end: float
    published: float  # runner sent the ids
    result_applied: float  # core finished applying them
    num_tokens: int
    num_seqs: int
    num_prefill_tokens: int
    schedule_ms: float
    prepare_ms: float
    forward_ms: float
    sample_ms: float
    apply_ms: float
    idle_before_ms: float  # device idle between the previous step and this one, work waiting
    waiting: bool  # requests were in the engine during that gap
    num_cached_tokens: int = 0  # tokens requests admitted this step found in the prefix cache


class TimelineSummary(msgspec.Struct, gc=False):
    busy_s: float  # device busy over every step since start
    idle_s: float  # device idle while work was waiting, since start
    idle_fraction: float  # idle_s / (busy_s + idle_s)


class Timeline(_Msg):
    token: int
    device: str  # "cpu", "cuda" or "sim:<profile>"
    overlap: bool
    steps: list[StepRecord]
    summary: TimelineSummary


class QueueState(_Msg):
    """The core's waiting queue as admission control needs it, sent to every frontend when it
    changed, at most every QUEUE_STATE_INTERVAL_S. Lists are indexed by frontend id; "waiting"
    means waiting for a seat (preempted requests included), counted per engine request."""

    waiting: list[int]  # requests
    waiting_tokens: list[int]  # their prompt tokens
    tenant_waiting: list[dict[str, int]]  # requests per tenant (tenants with none left out)
    drain_per_s: float  # seats freed per second (requests that ended or were preempted), last 10 s
    replica: int = 0  # whose core (--data-parallel-size)


QUEUE_STATE_INTERVAL_S = 0.02


class LoraAdapters(_Msg):
    """The adapters a core serves, sent to every frontend when they change; to the frontend
    that asked, with its LoadLora's or UnloadLora's token and, if it failed, why (`status`:
    the HTTP status the error is)."""

    names: list[str]
    token: int = -1  # -1: no one's answer
    error: str = ""
    status: int = 200


FrontendInput = (
    TextDeltas
    | EngineDead
    | EngineStats
    | Timeline
    | QueueState
    | Heartbeat
    | PrefixCacheReset
    | LoraAdapters
)


# ---------------------------------------------------------------- every process -> supervisor


class Ready(_Msg):
    role: str
    pid: int
    info: dict[str, int] = {}


class Fatal(_Msg):
    role: str
    message: str


ControlMessage = Ready | Fatal
