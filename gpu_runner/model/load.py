"""A model on its device: built without weights (on the meta device, or on the cpu without
its random init), then its weights loaded in place."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
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
    if device.type == "cpu":
        # why not the meta device here: its first use in a process imports torch's meta
        # registrations, about 2.5 s of CPU in every cpu runner's start, more than the
        # model's own allocation
        with _without_init():
            model = CausalLM(arch, tp)
        model = model.to(dtype)
    else:
        with torch.device("meta"):
            model = CausalLM(arch, tp)
        model = model.to_empty(device=device).to(dtype)
    model.load(weights)
    return model


_INITS = {
    name: getattr(torch.nn.init, name)
    for name in ("kaiming_uniform_", "uniform_", "normal_", "zeros_", "ones_", "trunc_normal_")
}
_init_lock = threading.Lock()


@contextlib.contextmanager
def _without_init() -> Iterator[None]:
    """torch.nn layers made in this block skip their random init (the layers call these
    through torch.nn.init when they are made); their weights are loaded right after. One
    block at a time (tests load tensor-parallel ranks as threads of one process), and the
    functions always go back to torch's own."""
    with _init_lock:
        try:
            for name in _INITS:
                setattr(torch.nn.init, name, _keep)
            yield
        finally:
            for name, init in _INITS.items():
                setattr(torch.nn.init, name, init)


def _keep(tensor: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
    return tensor
