"""A model on its device: built on the meta device, then its weights loaded in place."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from gapless.common.config import ModelInfo
from gapless.common.model_files import ModelArch
from gapless.gpu_runner.model.decoder import CausalLM
from gapless.gpu_runner.model.shard import Sharder, local_arch
from gapless.gpu_runner.model.weights import load_weights

if TYPE_CHECKING:
    from gapless.gpu_runner.tensor_parallel import TensorParallel

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def load_model(
    info: ModelInfo,
    arch: ModelArch,
    device: torch.device,
    dtype: torch.dtype,
    tp: TensorParallel | None = None,
) -> CausalLM:
    """The model's weights in dtype on device, in training mode (callers quantize, then eval).
    arch is the whole model's; with tp, the model is the rank's share of it."""
    weights = load_weights(info, arch, dtype)
    if tp is not None:
        weights = Sharder(arch, tp.rank, tp.size).shard(weights)
        arch = local_arch(arch, tp.rank, tp.size)
    with torch.device("meta"):
        model = CausalLM(arch, tp)
    model = model.to_empty(device=device).to(dtype)
    model.load(weights)
    return model
