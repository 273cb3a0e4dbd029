"""Incremental detokenization, stop strings with hold-back, logprob text."""
