"""TP=2 `gapless serve` on the cpu device (gloo): the openai client, a rank stopped and one
killed under load, and two hosts on loopback (two commands) serving one runner's tokens."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from gapless.common.model_files import load_tokenizer
from tests.engine_harness import make_config
from tests.family_models import build
from tests.gpu_runner.test_tensor_parallel import GREEDY, Recorder, _prompts
from tests.server import ROOT, Server, count_server_start, free_port

# in file order: the TP server is shared, and the killed-rank test ends it, so it runs last
pytestmark = [pytest.mark.slow, pytest.mark.randomly_dont_reorganize]

# ------------------------------------------------------------------ a TP=2 server

LONG = {"model": "tiny", "prompt": "count with me", "max_tokens": 1500, "ignore_eos": True,
        "temperature": 0, "stream": True}  # fmt: skip


@pytest.fixture(scope="module")
def tp_server(tiny_model_dir) -> Iterator[Server]:
    """`gapless serve --tp 2` on the tiny Llama; the last test of this file kills a rank."""
    s = Server("--model", str(tiny_model_dir), "--dtype", "float32", "--served-model-name",
               "tiny", "--max-model-len", "2048", "--tp", "2", "--stall-timeout", "1")  # fmt: skip
    yield s
    s.stop()


def _started(stream, streams: list[list[str]], events: int) -> list[threading.Thread]:
    """A thread of stream(events) for each list of streams, once each holds `events` lines."""
    threads = [threading.Thread(target=stream, args=(got,)) for got in streams]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while not all(len(got) >= events for got in streams):
        assert time.monotonic() < deadline, "the streams did not start"
        time.sleep(0.01)
    return threads


def test_a_tp2_server_answers_the_openai_client(tp_server):
    import openai

    names = tp_server.child_pids()
    assert "gapless-runner" in names and "gapless-runner1" in names, names
    client = openai.OpenAI(base_url=tp_server.url + "/v1", api_key="x", max_retries=0,
                           timeout=60)  # fmt: skip
    r = client.completions.create(model="tiny", prompt="one two three", max_tokens=6,
                                  temperature=0, logprobs=1)  # fmt: skip
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 6
    assert len(r.choices[0].logprobs.tokens) == 6
    again = client.completions.create(model="tiny", prompt="one two three", max_tokens=6,
                                      temperature=0)  # fmt: skip
    assert again.choices[0].text == r.choices[0].text, "greedy repeats itself"
    chunks = list(client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5,
        temperature=0, stream=True, stream_options={"include_usage": True},
    ))  # fmt: skip
    assert chunks[-1].usage.completion_tokens == 5
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_a_stopped_rank_is_a_stall_until_it_goes_on(tp_server):
    """Rank 1 stopped under load holds rank 0 in its collective: /health is 503 stalled within
    --stall-timeout (1 s; the tiny model's steps are ms) and a heartbeat, far before
    --dist-timeout (120 s); after SIGCONT 200 again and every stream completes. Margins: 5 s."""
    s = tp_server
    rank1 = s.child_pids()["gapless-runner1"]
    body = {**LONG, "max_tokens": 200}
    streams: list[list[str]] = [[] for _ in range(3)]

    def stream(events: list[str]) -> None:
        with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=60) as r:
            events.extend(line for line in r.iter_lines() if line)

    threads = _started(stream, streams, 2)
    os.kill(rank1, signal.SIGSTOP)
    try:
        stopped_at = time.monotonic()
        while (r := httpx.get(s.url + "/health", timeout=2)).status_code == 200:
            assert time.monotonic() - stopped_at < 1.5 + 5, "/health 200 with a rank stopped"
            time.sleep(0.1)
        assert r.status_code == 503 and r.json()["status"] == "stalled", r.text
    finally:
        os.kill(rank1, signal.SIGCONT)
    resumed_at = time.monotonic()
    while (r := httpx.get(s.url + "/health", timeout=2)).status_code != 200:
        assert time.monotonic() - resumed_at < 5, r.text
        time.sleep(0.1)
    for t, events in zip(threads, streams, strict=True):
        t.join(60)
        assert events[-1] == "data: [DONE]", events[-3:]
        assert not any('"error"' in e for e in events), events[-3:]


def test_a_killed_rank_ends_every_stream_and_the_engine(tp_server):
    s = tp_server
    run_dir = s.run_dir()
    children = s.child_pids()
    streams: list[list[str]] = [[] for _ in range(3)]
    ended: list[float] = []

    def stream(events: list[str]) -> None:
        try:
            with httpx.stream("POST", s.url + "/v1/completions", json=LONG, timeout=30) as r:
                for line in r.iter_lines():
                    events.append(line)
        except httpx.HTTPError as e:
            events.append(f"transport error: {e}")
        ended.append(time.monotonic())

    threads = _started(stream, streams, 3)
    os.kill(children["gapless-runner1"], signal.SIGKILL)
    killed_at = time.monotonic()
    for t in threads:
        t.join(10)
    assert len(ended) == 3 and max(ended) - killed_at < 5, (ended, killed_at)
    for events in streams:
        assert any('"error"' in e for e in events), events[-3:]
        assert [e for e in events if e][-1] == "data: [DONE]", events[-3:]
    assert httpx.get(s.url + "/health", timeout=2).status_code == 503
    assert s.proc.wait(30) == 1, "serve exits 1 when a rank dies"
    for name, pid in children.items():
        assert (
            not Path(f"/proc/{pid}").exists()
            or Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
        ), f"{name} still running"
    assert not os.path.exists(run_dir)


# ------------------------------------------------------------------ two hosts on loopback


def test_two_hosts_on_loopback_serve_one_runners_tokens(tmp_path, tiny_model_dir):
    """Host 0 (`--nnodes 2 --node-rank 0`: the server and rank 0) and host 1 (`--headless
    --node-rank 1`: rank 1 alone, reading the plans over TCP) give one runner's greedy tokens."""
    model = tmp_path / "llama"
    model.mkdir()
    build("llama", model, tiny_model_dir)
    prompt = _prompts()[1]
    one = Recorder(make_config(model))
    want = one.run({0: [("r", prompt, GREEDY)]})["r"]
    port = free_port()
    hosts = ["--tp", "2", "--nnodes", "2", "--master-port", str(port), "--model", str(model),
             "--dtype", "float32", "--served-model-name", "tiny"]  # fmt: skip
    count_server_start()  # one host of the two; the other is a Server
    headless = subprocess.Popen(
        [sys.executable, "-m", "gapless.launch.cli", "serve", "--headless", "--node-rank", "1",
         "--threads", "1", "--no-compile", *hosts],
        cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True,
    )  # fmt: skip
    try:
        server = Server(*hosts, "--node-rank", "0")
        try:
            body = {"model": "tiny", "prompt": prompt, "max_tokens": GREEDY.max_tokens,
                    "temperature": 0, "ignore_eos": True, "logprobs": 0}  # fmt: skip
            r = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
            lp = r["choices"][0]["logprobs"]["token_logprobs"]
            torch.testing.assert_close(torch.tensor(lp), torch.tensor(one.logprobs["r"]),
                                       atol=1e-4, rtol=0)  # fmt: skip
            text = load_tokenizer(one.core.config.model).decode(want)
            assert r["choices"][0]["text"] == text and len(lp) == len(want)
        finally:
            assert server.stop() == 0, server.read_log()
        assert headless.wait(30) == 0, "host 1's ranks stop with host 0's engine"
    finally:
        if headless.poll() is None:
            headless.kill()
        out = headless.communicate()[0]
    assert "Traceback" not in out, out


def test_a_host_that_never_joins_ends_the_engine(tiny_model_dir):
    """Host 1 never starts: host 0's ranks give up after --dist-timeout, and serve exits 1
    naming what it waited for, rather than hanging."""
    args = ["serve", "--tp", "2", "--nnodes", "2", "--node-rank", "0", "--master-port",
            str(free_port()), "--dist-timeout", "3", "--model", str(tiny_model_dir), "--dtype",
            "float32", "--threads", "1", "--no-compile", "--port", str(free_port())]  # fmt: skip
    count_server_start()
    # a hang fails at the timeout; --dist-timeout sets when the ranks give up
    out = subprocess.run([sys.executable, "-m", "gapless.launch.cli", *args], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 1, out.stdout + out.stderr
    assert "engine failed: gpu_runner" in out.stderr and "Timed out" in out.stderr, out.stderr[
        -3000:
    ]
