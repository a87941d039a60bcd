"""Honest evaluation: sampler cross-entropy (SCE-S) of the block chain, and teacher-forced CE of
the autoregressive baseline on the same held-out windows and positions; and the judge of generated
text (judge CE and form of continuations of fixed prompts, judge.py)."""
