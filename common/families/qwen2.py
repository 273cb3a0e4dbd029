"""Qwen2 / Qwen2.5: biases on q, k and v; a window on the layers past max_window_layers where
use_sliding_window is set."""

from __future__ import annotations

from gapless.common.families.base import Family, check_act, sliding


def windows(config: dict, rule=lambda i, config: i >= config.get("max_window_layers", 28)):
    """Sliding layers as config.json's layer_types names them, or by the family's rule."""
    if not config.get("use_sliding_window"):
        return {}
    n = int(config["num_hidden_layers"])
    kinds = config.get("layer_types") or [
        "sliding_attention" if rule(i, config) else "full_attention" for i in range(n)
    ]
    return sliding(config, kinds)


def options(config: dict) -> dict:
    check_act(config)
    return {"attention_bias": True, **windows(config)}


QWEN2 = Family(name="qwen2", model_types=("qwen2",), options=options, gguf_arch="qwen2")
