"""POST /tokenize, POST /detokenize and GET /version, shaped as vLLM serves them."""

from __future__ import annotations

from importlib import metadata

import msgspec

from gapless.frontend.api.openai_fields import check_fields, struct_fields
from gapless.frontend.api.params import check_model
from gapless.frontend.api.protocol import ChatMessage
from gapless.frontend.api.state import FrontendState
from gapless.frontend.api.tools import ToolPlan, template_messages
from gapless.frontend.http.asgi import HttpRequest, Responder
from gapless.frontend.http.errors import bad_request, decode_body


class TokenizeRequest(msgspec.Struct, kw_only=True):
    """A completion prompt, or chat messages rendered with the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True  # messages only


class TokenizeResponse(msgspec.Struct):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(msgspec.Struct):
    prompt: str


class Version(msgspec.Struct):
    version: str


_tokenize = msgspec.json.Decoder(TokenizeRequest)
_detokenize = msgspec.json.Decoder(DetokenizeRequest)


async def _body(req: HttpRequest, state: FrontendState, decoder: msgspec.json.Decoder):
    """The request decoded (a 400 naming what is wrong); fields outside it are ignored with a
    debug log, as on every route."""
    raw = await req.body(state.config.max_body_bytes)
    body = decode_body(decoder, raw)
    check_fields(raw, req.path, struct_fields(decoder.type), {})
    return body


async def handle_tokenize(state: FrontendState, req: HttpRequest, out: Responder) -> None:
    body = await _body(req, state, _tokenize)
    check_model(body.model, state.config)
    prompter = state.prompter
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("give either prompt or messages", param="prompt")
    if body.prompt is not None:
        ids = await prompter.completion_ids(body.prompt)
    else:
        assert body.messages is not None
        plan = ToolPlan(None, None, False)
        messages = template_messages(body.messages, plan, prompter.chat_template.takes_tools, True)
        ids = await prompter.chat_ids(messages, add_generation_prompt=body.add_generation_prompt)
    await out.json(200, TokenizeResponse(ids, len(ids), state.config.model.max_model_len))


async def handle_detokenize(state: FrontendState, req: HttpRequest, out: Responder) -> None:
    body = await _body(req, state, _detokenize)
    check_model(body.model, state.config)
    vocab = state.config.model.vocab_size
    for token in body.tokens:
        if not 0 <= token < vocab:
            raise bad_request(
                f"tokens holds {token}, outside the vocabulary [0, {vocab})", param="tokens"
            )
    await out.json(200, DetokenizeResponse(state.prompter.decode(body.tokens)))


def version() -> Version:
    try:
        return Version(metadata.version("gapless"))
    except metadata.PackageNotFoundError:
        return Version("unknown")
