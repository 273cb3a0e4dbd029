"""A model may declare a context of 10^7, 10^9 or 2^32 - 1 tokens (real checkpoints declare
millions): what is sized per sequence (the runner's block tables, the core's output ids) is
bounded by the KV blocks the cache holds, since no sequence can hold more, so such a model
costs what the cache costs and is served."""

from __future__ import annotations

import json
import shutil

import msgspec

from gapless.common.config import EngineConfig
from gapless.common.messages import SamplingParams
from gapless.gpu_runner.batch import batch_for
from tests.engine_harness import Harness, make_config

HUGE = 2**32 - 1
BS = 16


def _with_context(config: EngineConfig, tokens: int) -> EngineConfig:
    return msgspec.structs.replace(
        config, model=msgspec.structs.replace(config.model, max_model_len=tokens)
    )


def test_block_tables_hold_what_the_cache_holds(tiny_model_dir):
    config = make_config(tiny_model_dir, block_size=BS, max_num_seqs=8)
    huge = batch_for(_with_context(config, HUGE), "cpu", 100)
    assert huge.block_table.shape == (8, 99)  # block 0 is never a sequence's
    short = batch_for(_with_context(config, 100), "cpu", 100)
    assert short.block_table.shape == (8, 7)  # a short context keeps its own bound


def test_a_context_of_2_32_tokens_is_served_in_the_memory_of_its_cache(tiny_model_dir, tmp_path):
    """The tiny Llama declaring a context of 2^32 - 1 (its weights and plain RoPE unchanged)
    serves the same greedy tokens as with its own 2048; on 32f0eca its block tables alone
    asked for 128 GiB."""
    huge = tmp_path / "huge"
    shutil.copytree(tiny_model_dir, huge)
    config = json.loads((huge / "config.json").read_text())
    (huge / "config.json").write_text(json.dumps({**config, "max_position_embeddings": HUGE}))
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outputs = []
    for path in (tiny_model_dir, huge):
        h = Harness(make_config(path, block_size=BS, max_num_seqs=4, kv_cache_memory=2**20))
        outputs.append(h.run({0: [("r", [5, 6, 7, 8], params)]})["r"])
    assert h.core.config.model.max_model_len == HUGE
    blocks = h.backend.num_blocks
    assert h.backend.batch.block_table.shape == (4, blocks - 1)
    assert h.scheduler.rb.out.shape == (4, (blocks - 1) * BS)
    assert outputs[1] == outputs[0] and len(outputs[0]) == 6
