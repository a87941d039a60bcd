"""Corpora (bundled WikiText-2 or a user path) and deterministic training/evaluation windows."""
