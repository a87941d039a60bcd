"""Training: per-block and autoregressive trainers, and the single-process training loops."""
