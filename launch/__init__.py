"""The entry point: the `gapless` CLI, the supervisor that starts the engine processes, and
the per-process worker entry."""
