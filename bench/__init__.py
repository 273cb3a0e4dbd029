"""The bench CLI: load generator, workloads, metrics, plots."""
