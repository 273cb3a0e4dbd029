"""Tensor parallelism on cuda (NCCL, rank r on GPU r), for a host with two GPUs: two ranks under
the real EngineCore against one runner on GPU 0, both bfloat16 with CUDA graphs (the
collectives captured inside them)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.engine_harness import make_config
from tests.family_models import build
from tests.gpu_runner.test_tensor_parallel import (
    Ranks,
    Recorder,
    _arrivals,
    _prompts,
    _random_biases,
)

transformers = pytest.importorskip("transformers")
TWO_GPUS = torch.cuda.is_available() and torch.cuda.device_count() >= 2
HAS_FLASHINFER = importlib.util.find_spec("flashinfer") is not None
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (TWO_GPUS and HAS_FLASHINFER), reason="needs 2 GPUs and flashinfer"),
]


@pytest.mark.parametrize("overrides", [{}, {"num_key_value_heads": 1}], ids=["llama", "kv1"])
def test_two_gpus_give_one_gpus_greedy_tokens(overrides, tmp_path, tiny_model_dir):
    model = tmp_path / "model"
    model.mkdir()
    build("llama", model, tiny_model_dir, attention_bias=True, **overrides)
    _random_biases(model)
    # a small cache each: the runner on GPU 0 keeps its own while rank 0 starts beside it
    config = make_config(model, device="cuda", dtype="bfloat16", max_num_seqs=8,
                         kv_cache_memory=64 * 2**20)  # fmt: skip
    prompts = _prompts()
    one = Recorder(config)
    want = one.run(_arrivals(prompts))
    (tmp_path / "run").mkdir()
    ranks = Ranks(config, tmp_path / "run", 2)
    try:
        two = Recorder(config, ranks)
        got = two.run(_arrivals(prompts))
    finally:
        ranks.close()
    assert got == want
    for rid in want:  # bfloat16, summed in another order
        lp = torch.tensor(two.logprobs[rid])
        torch.testing.assert_close(lp, torch.tensor(one.logprobs[rid]), atol=2e-2, rtol=0)
    assert [p.returncode for p in ranks.procs] == [0, 0]
