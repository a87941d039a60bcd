"""Corpora (bundled WikiText-2, a prepared dataset, a user path) and deterministic training/evaluation windows."""

DEFAULT_CACHE_GB = 20.0  # --data-cache-gb: disk a remote dataset's shard cache may use (light: the CLI reads it)
