"""Sampling on the device: the sampler, logit rules, logprobs, grammar rows."""
