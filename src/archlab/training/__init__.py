"""Training: the trainer, its config, optimizer and schedule, precision, data parallelism, recompute,
throughput, metrics and RNG state."""
