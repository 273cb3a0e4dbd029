"""A model on its device: built on the meta device, then its weights loaded in place."""

from __future__ import annotations

import torch

from gapless.common.config import ModelInfo
from gapless.common.model_files import ModelArch
from gapless.gpu_runner.model.decoder import CausalLM
from gapless.gpu_runner.model.weights import load_weights

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def load_model(
    info: ModelInfo, arch: ModelArch, device: torch.device, dtype: torch.dtype
) -> CausalLM:
    """The model's weights in dtype on device, in training mode (callers quantize, then eval)."""
    with torch.device("meta"):
        model = CausalLM(arch)
    model = model.to_empty(device=device).to(dtype)
    model.load(load_weights(info, arch, dtype))
    return model
