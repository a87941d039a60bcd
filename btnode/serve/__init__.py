"""Serving: a chain of stages, each holding one block (or a slice of the AR baseline's layers).
The same driver and stage code run locally and across the network (rpc/ wraps a stage)."""
