"""The worker role: train one block, push compressed deltas, follow the published versions."""
