"""The device process: weights, paged KV cache, persistent batch, sampler."""

import os as _os

from gapless.common.model_cache import cache_dir as _cache_dir

# torch.compile's on-disk cache inside gapless's cache directory, unless set. why here: torch
# fixes its default (a /tmp directory) the first time anything asks, and importing xgrammar
# (gpu_runner/sampling/grammar.py) already does
_os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(_cache_dir() / "inductor"))
