"""Aggregation: round state, averaging rules and the per-block aggregator (design §3.3)."""
