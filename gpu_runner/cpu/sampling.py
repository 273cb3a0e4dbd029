"""How the cpu device samples (sampling/sampler.py's SamplingPaths), and why:

- blocks of rows whose float32 [rows, V] temporaries stay in the CPU's caches beat one pass
  over the whole [B, V] batch several times;
- top_p without top_k by rejection (sampling/nucleus.py) skips a sort of the vocabulary per
  row, which on a cpu costs more than the forward;
- numpy's argmax over float32 rows is several times faster than torch's max with indices
  (bench/RESULTS.md, "attention's vector path, fused projections, numpy's argmax").
"""

from __future__ import annotations

from gapless.gpu_runner.sampling.sampler import SamplingPaths

CPU_SAMPLING = SamplingPaths(block_elements=1 << 18, sort_free_top_p=True, host_argmax=True)
