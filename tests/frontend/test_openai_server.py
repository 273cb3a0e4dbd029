"""The official openai client against a real `gapless serve` on a tiny random Llama."""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import json
from typing import Literal

import httpx
import openai
import pytest

from tests.server import Server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    store = tmp_path_factory.mktemp("responses") / "responses.sqlite"
    s = Server(
        "--responses-store",
        str(store),
        "--model",
        str(tiny_model_dir),
        "--dtype",
        "float32",
        "--served-model-name",
        "tiny",
        "--max-num-seqs",
        "40",
        "--max-model-len",
        "512",
    )
    yield s
    assert s.stop() == 0, s.read_log()


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_completion_and_usage(client):
    r = client.completions.create(
        model="tiny",
        prompt="Hello there",
        max_tokens=5,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 5 and r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + 5


def test_streaming_completion_equals_non_streaming(client):
    kw = dict(
        model="tiny",
        prompt="Once upon a time",
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    whole = client.completions.create(**kw).choices[0].text
    chunks = list(
        client.completions.create(stream=True, stream_options={"include_usage": True}, **kw)
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_chat_streaming_and_not(client):
    msgs = [{"role": "user", "content": "Say hi"}]
    r = client.chat.completions.create(
        model="tiny", messages=msgs, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.choices[0].message.role == "assistant" and r.usage.completion_tokens == 6
    stream = client.chat.completions.create(
        model="tiny",
        messages=msgs,
        max_tokens=6,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == r.choices[0].message.content


def test_prompt_as_token_ids(client):
    r = client.completions.create(
        model="tiny",
        prompt=[1, 2000, 3000],
        max_tokens=3,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert r.usage.prompt_tokens == 3 and r.usage.completion_tokens == 3


def test_seeded_sampling_repeats(client):
    kw = dict(
        model="tiny",
        prompt="abc",
        max_tokens=10,
        temperature=1.0,
        seed=42,
        extra_body={"ignore_eos": True},
    )
    first, second = client.completions.create(**kw), client.completions.create(**kw)
    assert first.usage.completion_tokens == second.usage.completion_tokens == 10
    assert first.choices[0].text == second.choices[0].text


def test_32_concurrent_greedy_streams_equal_their_solo_output(client):
    prompts = [f"Request number {i} says" for i in range(32)]

    def run(p: str) -> str:
        stream = client.completions.create(
            model="tiny",
            prompt=p,
            max_tokens=16,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        return "".join(c.choices[0].text for c in stream if c.choices)

    solo = [run(p) for p in prompts[:8]]
    with cf.ThreadPoolExecutor(32) as pool:
        together = list(pool.map(run, prompts))
    assert all(together), "every stream produced text"
    assert together[:8] == solo
    again = [run(p) for p in prompts[8:12]]
    assert together[8:12] == again


def test_bad_inputs_get_clear_errors_and_the_engine_goes_on(server, client):
    url = server.url + "/v1/completions"
    cases = [
        ({"model": "tiny", "prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
        ({"model": "tiny", "prompt": "x", "max_tokens": 10**9}, 400, "max_tokens"),
        ({"model": "tiny", "prompt": "x", "n": 1000}, 400, "n"),
        ({"model": "tiny", "prompt": "x", "logprobs": 1000}, 400, "logprobs"),
        ({"model": "tiny", "prompt": ""}, 400, "prompt"),
        ({"model": "tiny", "prompt": "hello " * 600}, 400, "prompt"),
        ({"model": "nope", "prompt": "x"}, 404, "model"),
    ]
    for body, status, field in cases:
        r = httpx.post(url, json=body, timeout=30)
        assert r.status_code == status, (body, r.text)
        assert field in r.json()["error"]["message"], r.text
    r = httpx.post(
        server.url + "/v1/chat/completions",
        timeout=30,
        json={"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]},
    )
    assert r.status_code == 400 and "role" in r.json()["error"]["message"]
    r = httpx.post(url, content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400
    r = httpx.post(url, content=b"x" * (5 * 2**20), headers={"content-type": "application/json"})
    assert r.status_code == 413
    assert httpx.get(server.url + "/v1/nothing").status_code == 404
    # and the engine still serves
    ok = client.completions.create(
        model="tiny", prompt="still alive", max_tokens=2, extra_body={"ignore_eos": True}
    )
    assert ok.usage.completion_tokens == 2


def test_models_and_openapi(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    spec = httpx.get(server.url + "/openapi.json").json()
    assert "/v1/chat/completions" in spec["paths"] and "/v1/completions" in spec["paths"]


def test_embeddings_equal_transformers_base64_and_float(client, tiny_model_dir):
    """client.embeddings.create (base64, the client's default) and float: the last token's
    final hidden state, normalized (no sentence-transformers files), as transformers has it;
    batched equals alone. Mean and CLS pooling: tests/gpu_runner/test_pooling.py."""
    import numpy as np
    import tokenizers
    import torch
    import transformers

    texts = ["The capital of France is Paris.", "Queues grow when the device waits."]
    b64 = client.embeddings.create(model="tiny", input=texts)
    floats = client.embeddings.create(model="tiny", input=texts, encoding_format="float")
    alone = client.embeddings.create(model="tiny", input=texts[1])
    tok = tokenizers.Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    ref = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir).float().eval()
    ids = [tok.encode(t).ids for t in texts]
    assert b64.usage.prompt_tokens == b64.usage.total_tokens == sum(map(len, ids))
    for i, prompt in enumerate(ids):
        with torch.no_grad():
            want = ref.model(torch.tensor([prompt])).last_hidden_state[0, -1].numpy()
        got = np.asarray(b64.data[i].embedding)
        assert float(got @ want / np.linalg.norm(want)) >= 0.9999
        np.testing.assert_allclose(floats.data[i].embedding, got, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(alone.data[0].embedding, b64.data[1].embedding, atol=1e-6)
    with pytest.raises(openai.BadRequestError) as err:
        client.embeddings.create(model="tiny", input=[])
    assert err.value.body["param"] == "input"


# ------------------------------------------------------------------ /v1/responses

CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
    "required": ["city"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "name": "get_weather", "parameters": CITY, "strict": True}
GREEDY = {"model": "tiny", "temperature": 0, "extra_body": {"ignore_eos": True}}


def test_responses_a_string_and_items_streamed_and_not(client):
    r = client.responses.create(input="Say hi", max_output_tokens=6, **GREEDY)
    assert r.status == "incomplete" and r.usage.output_tokens == 6
    with client.responses.stream(input="Say hi", max_output_tokens=6, **GREEDY) as stream:
        events = list(stream)  # cut by max_output_tokens: no response.completed to wait for
    final = events[-1]
    assert final.type == "response.incomplete" and final.response.output_text == r.output_text
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == r.output_text
    chat = client.chat.completions.create(
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        max_tokens=5,
        **GREEDY,
    )
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]}]
    r = client.responses.create(
        instructions="Be brief.", input=items, max_output_tokens=5, **GREEDY
    )
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens


def test_responses_a_forced_call_and_its_output_continue(server, client):
    """The call comes back as a function_call item; its output, sent with previous_response_id,
    continues a prompt holding the question, the call and the output: exactly the chat
    template's tokens of those three messages."""
    r = client.responses.create(
        input="Weather in Paris?",
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=40,
        **GREEDY,
    )
    [call] = r.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments)["city"] in ("Paris", "Rome")
    follow = client.responses.create(
        previous_response_id=r.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
        max_output_tokens=4,
        **GREEDY,
    )
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call.call_id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"},
    ]
    tokens = httpx.post(server.url + "/tokenize", json={"messages": messages}, timeout=30).json()
    assert follow.usage.input_tokens == tokens["count"]
    listed = client.responses.input_items.list(follow.id, order="asc").data
    assert [it.type for it in listed] == ["message", "function_call", "function_call_output"]


def test_responses_text_format_json_schema_parses(client):
    fmt = {"type": "json_schema", "name": "city", "schema": CITY, "strict": True}
    r = client.responses.create(
        input="A city?", text={"format": fmt}, max_output_tokens=40, model="tiny", temperature=0
    )
    assert r.status == "completed"
    assert json.loads(r.output_text)["city"] in ("Paris", "Rome")


def test_responses_retrieve_list_delete_store_false_and_tenants(server, client):
    r = client.responses.create(input="keep", max_output_tokens=3, **GREEDY)
    assert client.responses.retrieve(r.id).output_text == r.output_text
    assert client.responses.input_items.list(r.id).data[0].content[0].text == "keep"
    other = openai.OpenAI(
        base_url=server.url + "/v1",
        api_key="unused",
        max_retries=0,
        default_headers={"X-Tenant": "other"},
    )
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        other.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        other.responses.create(model="tiny", input="x", previous_response_id=r.id)
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    gone = client.responses.create(input="forget", store=False, max_output_tokens=2, **GREEDY)
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list(gone.id)


def test_responses_a_stored_response_outlives_the_server_that_stored_it(server, client):
    """A second `gapless serve` on the same store answers and is stopped (SIGTERM, as a
    restart stops it); what it stored is read back through this module's server."""
    args = server.proc.args[server.proc.args.index("--responses-store") :]
    other = Server(*args)
    try:
        c = openai.OpenAI(base_url=other.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        r = c.responses.create(input="outlive", max_output_tokens=3, **GREEDY)
    finally:
        assert other.stop() == 0, other.read_log()
    assert client.responses.retrieve(r.id).output_text == r.output_text
    assert client.responses.input_items.list(r.id).data[0].content[0].text == "outlive"


def test_the_agents_sdk_runs_an_agent_with_a_function_tool(server):
    """The Agents SDK's Responses model: a forced first turn calls the tool, whose output goes
    back with the whole history, and the second turn (tool_choice reset to auto) answers."""
    from agents import (
        Agent,
        ModelSettings,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)
    asked: list[str] = []

    @function_tool
    def get_weather(city: Literal["Paris", "Rome"]) -> str:
        """The weather in a city."""
        asked.append(city)
        return "sunny"

    async def run():
        async_client = openai.AsyncOpenAI(
            base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60
        )
        agent = Agent(
            name="weather",
            instructions="Answer with the weather.",
            tools=[get_weather],
            model=OpenAIResponsesModel(model="tiny", openai_client=async_client),
            model_settings=ModelSettings(
                tool_choice="required",
                max_tokens=48,
                parallel_tool_calls=False,
                temperature=0,
                # why: the random model never ends on its own; EOS (2) once a call's grammar
                # allows it, and at once in the answer
                extra_body={"logit_bias": {"2": 100}},
            ),
        )
        return await Runner.run(agent, "Weather in Paris?", max_turns=3)

    result = asyncio.run(run())
    assert asked and asked[0] in ("Paris", "Rome")
    first, last = result.raw_responses[0], result.raw_responses[-1]
    assert [it.type for it in first.output] == ["function_call"]
    assert isinstance(result.final_output, str) and last.output[-1].type == "message"
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    sent = client.responses.input_items.list(last.response_id, order="asc").data
    assert [it.type for it in sent] == ["message", "function_call", "function_call_output"]
    assert sent[2].output == "sunny" and sent[1].call_id == sent[2].call_id
