"""The device process: weights, paged KV cache, persistent batch, sampler."""
