"""Tensor parallelism on the cpu device: the split's arithmetic, the plans' channel, each
family's options over ranks in threads, and TP=2 runner processes (gloo) driven by the real
EngineCore against one runner in process (the same greedy tokens, with prefix caching,
preemption and overlap on). Whole servers: test_tensor_parallel_serve.py."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgspec
import pytest
import torch
import zmq

from gapless.common.channel import Publisher, Receiver
from gapless.common.config import CONFIG_ENV, EngineConfig, encode_config
from gapless.common.families.base import ModelArch
from gapless.common.messages import (
    ControlMessage,
    Fatal,
    RunnerOutput,
    RunnerReady,
    SamplingParams,
    Shutdown,
    StepPlan,
    StepResult,
)
from gapless.common.process import CONTROL, RUNNER_OUT, RUNNER_PLANS
from gapless.common.shards import kv_head_range, q_head_range, split_problem, vocab_range
from gapless.gpu_runner.tensor_parallel import TensorParallel
from tests.engine_harness import Recorder, make_config
from tests.family_models import build
from tests.server import ROOT, free_port

transformers = pytest.importorskip("transformers")

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=0)
BLOCK = 4


# ------------------------------------------------------------------ the split's arithmetic


@pytest.mark.parametrize(
    "heads,kv_heads,size",
    [(4, 2, 2), (9, 3, 2), (8, 1, 2), (8, 2, 4), (12, 4, 8), (32, 8, 8), (6, 3, 3)],
)
def test_every_head_has_one_owner_and_queries_meet_their_kv_head(heads, kv_heads, size):
    owners = []
    for rank in range(size):
        q0, q1 = q_head_range(heads, kv_heads, size, rank)
        k0, k1 = kv_head_range(kv_heads, size, rank)
        assert q1 > q0 and k1 > k0
        group = heads // kv_heads
        # the K/V head of each of the rank's query heads is one of the rank's
        assert all(k0 <= q // group < k1 for q in range(q0, q1))
        owners += range(q0, q1)
    assert sorted(owners) == list(range(heads))


def test_the_vocabulary_splits_into_padded_chunks_that_cover_it():
    ranges = [vocab_range(49155, 4, r) for r in range(4)]
    assert ranges[0] == (0, 12289) and ranges[-1] == (36867, 49155)
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))


def test_a_split_the_model_cannot_take_is_named():
    arch = ModelArch(architecture="llama", vocab_size=100, hidden_size=64, intermediate_size=96,
                     num_layers=1, num_heads=6, num_kv_heads=3, head_dim=16, rope_theta=1e4,
                     rms_norm_eps=1e-5, max_position=64, tie_word_embeddings=True,
                     attention_bias=False)  # fmt: skip
    assert split_problem(arch, 1) is None and split_problem(arch, 2) is None
    assert split_problem(arch, 3) is None and split_problem(arch, 6) is None
    assert "3 K/V heads" in split_problem(arch, 4)
    assert "attention heads" in split_problem(arch, 12)


def test_sim_models_the_ranks_in_one_process(default_gguf):
    """--tp N on sim: one runner whose profile splits weights, heads and KV over N GPUs and
    adds the all-reduces: more KV blocks, a shorter decode of a big batch."""
    from gapless.gpu_runner.sim.backend import SimBackend
    from gapless.gpu_runner.sim.profiles import step_time
    from tests.conftest import sim_config

    sims = {n: SimBackend(sim_config(default_gguf, tensor_parallel_size=n, max_num_seqs=256))
            for n in (1, 2, 8)}  # fmt: skip
    assert [sims[n].profile.tp for n in (1, 2, 8)] == [1, 2, 8]
    assert all(sim.config.num_ranks == 1 for sim in sims.values())
    assert sims[1].num_blocks < sims[2].num_blocks
    decode = {n: step_time(s.profile, 256, 256, 256 * 1024) for n, s in sims.items()}
    assert decode[8] < decode[2] < decode[1]


# ------------------------------------------------------------------ the plans' channel


def test_every_subscriber_gets_each_plan_once_and_a_lost_publisher_is_seen():
    """One publish reaches every rank; a rank on another host (tcp) learns that the core's
    publisher went away, where an idle rank would otherwise wait for plans forever."""
    from gapless.common.channel import Subscriber
    from gapless.common.messages import RunnerInput

    ctx = zmq.Context()
    address = f"tcp://127.0.0.1:{free_port()}"
    pub: Publisher = Publisher(ctx, address)
    subs = [Subscriber(ctx, address, RunnerInput) for _ in range(2)]
    try:
        assert pub.wait_subscribers(2, 5_000) and pub.num_subscribers == 2
        plan = StepPlan(seq=1, new_slots=[], freed_slots=[3], slots=[], num_tokens=[],
                        start_pos=[], has_tokens=[], token_ids=[], sample=[],
                        num_new_blocks=[], new_blocks=[])  # fmt: skip
        pub.send(plan)
        for sub in subs:
            assert sub.recv(timeout_ms=5_000) == plan
            assert sub.recv(timeout_ms=50) is None and not sub.lost()
        pub.close()
        deadline = time.monotonic() + 5
        while not all(sub.lost() for sub in subs):
            assert time.monotonic() < deadline, "the publisher's end went unnoticed"
            time.sleep(0.02)
    finally:
        for sub in subs:
            sub.close()
        ctx.term()


def _random_biases(model_dir: Path) -> None:
    """Biases drawn at random (transformers makes them zeros, which would hide one counted on
    every rank instead of once)."""
    from safetensors.torch import load_file, save_file

    path = model_dir / "model.safetensors"
    weights = load_file(path)
    gen = torch.Generator().manual_seed(5)
    for name, w in weights.items():
        if name.endswith(".bias"):
            weights[name] = torch.randn(w.shape, generator=gen) * 0.5
    save_file(weights, path, metadata={"format": "pt"})


# ------------------------------------------------------------------ ranks as threads


class ThreadGroup:
    """Collectives among threads of this process, summing in rank order as one all-reduce
    does, so every rank gets the same bits: the sharded model without processes."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.barrier = threading.Barrier(size, timeout=60)
        self.slots: list = [None] * size

    def exchange(self, rank: int, x):
        self.slots[rank] = x
        self.barrier.wait()
        parts = list(self.slots)
        self.barrier.wait()
        return parts


class ThreadRank(TensorParallel):
    def __init__(self, rank: int, group: ThreadGroup) -> None:
        super().__init__(rank, group.size)
        self.group = group

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        parts = self.group.exchange(self.rank, x.clone())
        return x.copy_(functools.reduce(torch.add, parts))

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat(self.group.exchange(self.rank, x), dim=-1)

    def min(self, value: int, device) -> int:
        return min(self.group.exchange(self.rank, value))


class ThreadRanks:
    """N CpuBackends of one group, each step launched on all of them at once (their layers
    meet in the collectives); rank 0's result is the step's."""

    def __init__(self, config: EngineConfig, size: int) -> None:
        from gapless.gpu_runner.cpu.backend import CpuBackend

        group = ThreadGroup(size)
        config = msgspec.structs.replace(config, tensor_parallel_size=size)
        self.pool = ThreadPoolExecutor(size)
        make = lambda r: CpuBackend(config, tp=ThreadRank(r, group))  # noqa: E731
        self.ranks = list(self.pool.map(make, range(size)))
        self.num_blocks = self.ranks[0].num_blocks

    def launch(self, plan: StepPlan) -> list:
        return list(self.pool.map(lambda rank: rank.launch(plan), self.ranks))

    def collect(self, handles: list) -> StepResult:
        results = [rank.collect(h) for rank, h in zip(self.ranks, handles, strict=True)]
        assert all(r.token_ids == results[0].token_ids for r in results), "ranks disagree"
        return results[0]


SHAPES = {  # name -> (family, its overrides, ranks)
    "llama-o-bias": ("llama", {"attention_bias": True}, 2),
    "uneven-heads": (
        "llama",
        {"hidden_size": 144, "num_attention_heads": 9, "num_key_value_heads": 3},
        2,
    ),  # the default model's heads
    "kv-replicated-4": ("llama", {}, 4),
    "qwen3-qk-norm": ("qwen3", {}, 2),
    "phi3-joined-qkv": ("phi3", {}, 2),
    "gemma2-sandwich": ("gemma2", {}, 2),
    "qwen2-moe-shared": ("qwen2_moe", {}, 2),
}


@pytest.mark.parametrize("shape", list(SHAPES))
def test_sharded_families_give_one_runners_tokens(shape, tmp_path, tiny_model_dir):
    """Each family's options over ranks (threads): an o_proj bias counted once, 9 heads over 3
    K/V heads on 2 ranks (3 and 6), 2 K/V heads each on 2 of 4 ranks, q/k norms, Phi-3's checkpoint with q/k/v
    and gate/up joined, Gemma 2's sandwich norms and soft caps, experts with a shared one."""
    family, overrides, size = SHAPES[shape]
    build(family, tmp_path, tiny_model_dir, **overrides)
    _random_biases(tmp_path)
    config = make_config(tmp_path)
    prompts = _prompts()
    arrivals = {i: [(f"r{i}", p, GREEDY)] for i, p in enumerate(prompts)}
    one = Recorder(config)
    want = one.run(arrivals)
    ranks = ThreadRanks(config, size)
    two = Recorder(config, ranks)
    assert two.run(arrivals) == want
    for rid in want:
        lp = torch.tensor(two.logprobs[rid])
        torch.testing.assert_close(lp, torch.tensor(one.logprobs[rid]), atol=1e-4, rtol=0)
    weights = [sum(p.numel() for p in r.model.parameters()) for r in ranks.ranks]
    assert max(weights) < sum(p.numel() for p in one.backend.model.parameters())


@pytest.mark.slow
def test_the_default_model_split_in_two_gives_its_tokens(default_gguf):
    """SmolLM2 from its GGUF in float32 (q/k rows un-interleaved, tied embeddings, 9 heads over
    3 K/V heads: 3 and 6 per rank), unquantized on both sides."""
    config = make_config(default_gguf, quantization="none", max_num_seqs=4)
    prompts = [[1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3717, 30, 2, 198]] + [
        p[:20] for p in _prompts()[:2]
    ]
    params = msgspec.structs.replace(GREEDY, max_tokens=12)
    arrivals = {i: [(f"r{i}", p, params)] for i, p in enumerate(prompts)}
    one = Recorder(config)
    want = one.run(arrivals)
    del one.backend  # why: its weights go before two ranks load theirs
    two = Recorder(config, ThreadRanks(config, 2))
    assert two.run(arrivals) == want
    for rid in want:
        lp = torch.tensor(two.logprobs[rid])
        torch.testing.assert_close(lp, torch.tensor(one.logprobs[rid]), atol=1e-3, rtol=0)


# ------------------------------------------------------------------ ranks under the real core


class Ranks:
    """N runner ranks as processes (`gapless.launch.worker gpu_runner RANK`), fed through the
    core's publisher: a Backend for the harness (launch publishes a plan, collect reads rank
    0's result)."""

    def __init__(self, config: EngineConfig, run_dir: Path, size: int) -> None:
        self.config = msgspec.structs.replace(
            config, run_dir=str(run_dir), tensor_parallel_size=size, master_port=free_port()
        )
        self.ctx = zmq.Context()
        self.control: Receiver[ControlMessage] = Receiver(
            self.ctx, self.config.ipc(CONTROL), ControlMessage
        )
        self.results: Receiver[RunnerOutput] = Receiver(
            self.ctx, self.config.ipc(RUNNER_OUT), RunnerOutput
        )
        self.plans: Publisher = Publisher(self.ctx, self.config.ipc(RUNNER_PLANS))
        env = dict(os.environ, **{CONFIG_ENV: encode_config(self.config)})
        self.procs = [
            subprocess.Popen([sys.executable, "-m", "gapless.launch.worker", "gpu_runner",
                              str(rank)], env=env, cwd=ROOT, stdin=subprocess.DEVNULL)
            for rank in range(size)
        ]  # fmt: skip
        ready = self._recv(180)
        assert isinstance(ready, RunnerReady), ready
        self.num_blocks = ready.num_kv_blocks
        assert self.plans.wait_subscribers(size, 30_000)

    def _recv(self, timeout_s: float) -> RunnerOutput:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            msg = self.results.recv(timeout_ms=100)
            if msg is not None:
                return msg
            fatal = self.control.drain()
            assert not [m for m in fatal if isinstance(m, Fatal)], fatal
            assert all(p.poll() is None for p in self.procs), "a rank exited"
        raise AssertionError("no result from rank 0")

    def launch(self, plan: StepPlan) -> int:
        self.plans.send(plan)
        return plan.seq

    def collect(self, seq: int) -> StepResult:
        result = self._recv(60)
        assert isinstance(result, StepResult) and result.seq == seq, result
        return result

    def close(self) -> None:
        self.plans.send(Shutdown())
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for socket in (self.control, self.results):
            socket.close()
        self.plans.close()
        self.ctx.term()


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(3, 40000, (n,), generator=gen).tolist() for n in (9, 30, 21)]


def _arrivals(prompts) -> dict:
    """Staggered arrivals, then the longest prompt again once it is cached: a prefix hit."""
    arrivals: dict = {i: [(f"r{i}", p, GREEDY)] for i, p in enumerate(prompts)}
    arrivals[40] = [("again", prompts[1], GREEDY)]
    return arrivals


def _kv_bytes(model_dir, blocks: int) -> int:
    from gapless.common.model_files import load_arch, resolve_model

    arch = load_arch(resolve_model(str(model_dir)))
    return blocks * 2 * arch.num_layers * BLOCK * arch.num_kv_heads * arch.head_dim * 4


@pytest.fixture(scope="module", params=["llama", "qwen2-kv1"])
def model_dir(request, tmp_path_factory, tiny_model_dir) -> Path:
    """Tiny random models of tests/family_models.py (untied embeddings: with tied random ones
    every token predicts itself): a Llama of 4 heads over 2 K/V heads, and a Qwen2 with
    attention biases and one K/V head, which both ranks replicate."""
    family, _, kv = request.param.partition("-")
    out = tmp_path_factory.mktemp(request.param)
    build(family, out, tiny_model_dir, **({"num_key_value_heads": 1} if kv else {}))
    _random_biases(out)
    return out


@pytest.mark.slow
def test_two_ranks_give_one_runners_greedy_tokens(model_dir, tmp_path):
    # 20 blocks of 4 tokens for requests of 33, 54, 45 and 54 tokens: preemption; overlap on;
    # the repeated prompt finds its blocks in the cache
    config = make_config(model_dir, block_size=BLOCK, max_num_batched_tokens=16,
                         kv_cache_memory=_kv_bytes(model_dir, 20))  # fmt: skip
    prompts = _prompts()
    one = Recorder(config)
    want = one.run(_arrivals(prompts))
    assert one.scheduler.num_preemptions > 0, "the small cache was meant to force preemption"
    # each rank holds half the K/V heads in half the memory: as many blocks; a replicated
    # K/V head takes each rank the memory of all of them
    kv_heads = json.loads((model_dir / "config.json").read_text())["num_key_value_heads"]
    memory = config.kv_cache_memory * (2 if kv_heads == 1 else 1)
    ranks = Ranks(msgspec.structs.replace(config, kv_cache_memory=memory), tmp_path, 2)
    try:
        assert ranks.num_blocks == one.backend.num_blocks
        two = Recorder(config, ranks)
        got = two.run(_arrivals(prompts))
    finally:
        ranks.close()
    assert got == want
    assert all(len(t) == GREEDY.max_tokens for t in got.values())
    for rid in want:  # the same numbers, up to the order of the all-reduce's sums
        lp = torch.tensor(two.logprobs[rid])
        torch.testing.assert_close(lp, torch.tensor(one.logprobs[rid]), atol=1e-4, rtol=0)
    assert two.cached.get("again", 0) > 0, "the repeated prompt found its prefix in the cache"
    assert two.scheduler.num_preemptions > 0
    assert two.max_inflight >= 2, "the ranks had step n+1 before step n's result was read"
    assert [p.returncode for p in ranks.procs] == [0, 0], "both ranks stopped on Shutdown"
