"""Mistral: Llama's layout with a sliding window over every layer, where config.json sets one."""

from __future__ import annotations

from gapless.common.families import llama
from gapless.common.families.base import Family, every_layer_slides


def options(config: dict) -> dict:
    return {**llama.options(config), **every_layer_slides(config)}


# llama.cpp writes Mistral's GGUF files as llama's (general.architecture "llama")
MISTRAL = Family(name="mistral", model_types=("mistral",), options=options)
