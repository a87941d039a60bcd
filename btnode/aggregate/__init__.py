"""Aggregation: `SwarmAggregator` (service.py) composed of sums/ (the exact arithmetic), trust/ (what
it checks), round/ (one block's round and its RoundSink) and relay/ (a relay's admission and sink)."""
