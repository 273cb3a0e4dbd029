"""Llama 2/3 and the models that kept its layout (SmolLM2, ...): the shared decoder, no options."""

from __future__ import annotations

from gapless.common.families.base import Family, check_act


def options(config: dict) -> dict:
    check_act(config)
    if config.get("mlp_bias"):
        raise NotImplementedError("MLP biases are not supported")
    bias = bool(config.get("attention_bias"))
    return {"attention_bias": bias, "o_bias": bias}


LLAMA = Family(
    name="llama",
    model_types=("llama",),
    options=options,
    gguf_arch="llama",
    gguf_permuted_qk=True,
)
