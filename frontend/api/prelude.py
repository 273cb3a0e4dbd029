"""What both generation routes do around their own fields, in the order they do it.

`Prelude.read`: the body read (bounded), decoded and its fields checked, the model, n, the
output budget as asked, logprobs, the sampling fields and the caller's tenant. Then the route
reads its own fields (tools, echo, ...). `admit`: the priority, the prefix-cache scope and the
admission decision (README, "Admission control": the request caps before the chat template and
tokenizing, the token cap after, with `admit_tokens`). `params`: each prompt's output budget and
its SamplingParams, built once that budget is known. `job` and `respond`: the engine's requests
and the answer.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import msgspec

from gapless.common.block_hash import adapter_scope, chain_hashes, hash_root
from gapless.common.config import EngineConfig
from gapless.common.messages import SamplingParams
from gapless.frontend.api.generation import ChoiceResult, respond
from gapless.frontend.api.openai_fields import Rule, check_fields, struct_fields
from gapless.frontend.api.params import (
    check_adapter_model,
    check_cache_salt,
    check_max_tokens,
    check_min_tokens,
    check_n,
    per_choice,
    resolve_max_tokens,
    sampling_fields,
)
from gapless.frontend.api.protocol import ChatCompletionRequest, CompletionRequest
from gapless.frontend.api.replies import Usage
from gapless.frontend.api.state import FrontendState
from gapless.frontend.api.stream import ChunkFormat, Job, RequestStream
from gapless.frontend.engine.queue_view import Ticket
from gapless.frontend.engine.tenants import Caller, cache_scope_of, priority_of, tenant_of
from gapless.frontend.http.asgi import HttpRequest, Responder
from gapless.frontend.http.errors import ApiError, decode_body

B = TypeVar("B", ChatCompletionRequest, CompletionRequest)


class Route(Generic[B]):
    """One generation route's reading of the fields both share."""

    def __init__(
        self,
        name: str,
        schema: type[B],
        refused: dict[str, Rule],
        id_prefix: str,
        budget: Callable[[B], tuple[int | None, str]],
        logprobs: Callable[[B, EngineConfig], int | None],
    ) -> None:
        self.name = name  # "completions" or "chat": for check_fields and the metrics
        self.decoder = msgspec.json.Decoder(schema)
        self.known = struct_fields(schema)
        self.refused = refused
        self.id_prefix = id_prefix  # of the response's id
        self.budget = budget  # the output budget asked (None: the rest of the context), its field
        self.logprobs = logprobs  # SamplingParams.logprobs, checked


def prompt_block_hashes(config: EngineConfig, prompt_ids: list[int], scope: str) -> list[bytes]:
    """The prefix-cache names of the prompt's full blocks in its cache scope (the Job's
    cache_salt, from tenants.cache_scope_of), so the core's step loop does not spend its time
    hashing (bench/RESULTS.md, "Block hashes in the frontend"); none with caching off."""
    if not config.prefix_caching:
        return []
    return chain_hashes(hash_root(config.model.path, scope), prompt_ids, config.block_size)


@dataclass
class Prelude(Generic[B]):
    """One generation request as both routes read it, from its body to its answer."""

    state: FrontendState
    route: Route[B]
    req: HttpRequest
    out: Responder
    body: B
    arrival: float  # time.time() as the request came
    received: float  # time.perf_counter() once its body was in: admission's clock starts
    n: int
    max_tokens: int | None  # as asked, within the context length; None: the rest of it
    budget_name: str  # the field that asked for it
    logprobs: int | None
    sampling: dict[str, Any]  # SamplingParams' checked fields but max_tokens; a route may add
    tenant: str
    response_id: str
    priority: int = 0  # from `admit` on
    cache_salt: str = ""  # the prefix-cache scope, from `admit` on
    lora: str = ""  # the LoRA adapter its `model` names; "": the served model

    @classmethod
    async def read(
        cls, state: FrontendState, req: HttpRequest, out: Responder, caller: Caller, route: Route[B]
    ) -> Prelude[B]:
        arrival = time.time()
        config = state.config
        raw = await req.body(config.max_body_bytes)
        received = time.perf_counter()
        body = decode_body(route.decoder, raw)
        check_fields(raw, route.name, route.known, route.refused)
        tenant = tenant_of(caller, req.headers.get("x-tenant"), body.user)
        lora = check_adapter_model(body.model, config, tenant, state.engine.lora_names)
        n = check_n(body.n, config)
        asked, budget_name = route.budget(body)
        max_tokens = check_max_tokens(asked, budget_name, config)
        logprobs = route.logprobs(body, config)
        bad_words = await state.prompter.bad_words_ids(body.bad_words)
        sampling = sampling_fields(body, logprobs, config, bad_words)
        return cls(
            state,
            route,
            req,
            out,
            body,
            arrival,
            received,
            n,
            max_tokens,
            budget_name,
            logprobs,
            sampling,
            tenant=tenant,
            response_id=f"{route.id_prefix}-{uuid.uuid4().hex}",
            lora=lora,
        )

    @property
    def created(self) -> int:
        return int(self.arrival)

    @property
    def model(self) -> str:
        return self.lora or self.state.config.served_model_name

    def admit(self, num_prompts: int = 1) -> Ticket:
        """The priority and the cache scope (400 if bad), then the request caps (429 / 503):
        a ticket counting n choices of each prompt as queued until each starts; release it
        when the request ends (`with` does)."""
        config, body = self.state.config, self.body
        self.priority = priority_of(body.priority, self.tenant, config)
        self.cache_salt = cache_scope_of(self.tenant, check_cache_salt(body.cache_salt), config)
        return self.state.admission.admit(self.tenant, self.n * num_prompts, self.received)

    def params(self, prompt_ids: list[int], prompt_param: str) -> SamplingParams:
        """The prompt's output budget (400 past the context, or below min_tokens) and its
        SamplingParams."""
        budget = resolve_max_tokens(
            self.max_tokens, self.budget_name, len(prompt_ids), prompt_param, self.state.config
        )
        check_min_tokens(self.sampling["min_tokens"], budget, self.budget_name)
        return SamplingParams(max_tokens=budget, **self.sampling)

    def admit_tokens(self, ticket: Ticket, prompts: list[list[int]]) -> None:
        """The token cap, once the prompts are tokenized (429 past it)."""
        num_tokens = sum(len(p) for p in prompts)
        self.state.admission.admit_tokens(ticket, num_tokens, self.received)

    def job(self, ticket: Ticket, prompts: list[list[int]], params: list[SamplingParams]) -> Job:
        """The engine's requests: n choices of each prompt, with its params (choice i of a
        prompt sampling with seed + i)."""
        state, n = self.state, self.n
        choice_prompts: list[list[int]] = []
        choice_params: list[SamplingParams] = []
        block_hashes: list[list[bytes]] = []
        for prompt, p in zip(prompts, params, strict=True):
            scope = adapter_scope(self.cache_salt, self.lora)  # as the core scopes it
            hashes = prompt_block_hashes(state.config, prompt, scope)
            choice_prompts += [prompt] * n
            choice_params += per_choice(p, n)
            block_hashes += [hashes] * n
        return Job(
            self.route.name,
            state.engine.next_request_id(),
            choice_prompts,
            choice_params,
            self.tenant,
            self.priority,
            self.arrival,
            ticket,
            label=self.req.request_id,
            stats=self.req.stats,
            cache_salt=self.cache_salt,
            num_prompt_tokens=sum(len(p) for p in prompts),
            block_hashes=block_hashes,
            lora=self.lora,
        )

    async def respond(
        self,
        job: Job,
        fmt: ChunkFormat,
        build: Callable[[list[ChoiceResult], Usage], object],
        writer: Callable[[RequestStream, Responder], Awaitable[None]] | None = None,
        cut: Callable[[ApiError], bytes] | None = None,
    ) -> None:
        """Streams the answer as `fmt` shapes its chunks (or as `writer` writes it, and `cut`
        its last frames when a reader too slow is cut off), or answers whole with `build`."""
        body = self.body
        await respond(
            self.state,
            job,
            self.req,
            self.out,
            streaming=bool(body.stream),
            include_usage=bool(body.stream_options and body.stream_options.include_usage),
            fmt=fmt,
            build=build,
            writer=writer,
            cut=cut,
        )
