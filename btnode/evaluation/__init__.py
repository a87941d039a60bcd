"""Honest evaluation: sampler cross-entropy (SCE-S) of the block chain, and teacher-forced CE of
the autoregressive baseline on the same held-out windows and positions."""
