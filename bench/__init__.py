"""The benchmarks: each module is a measurement plus a table, run from the repository root as
`python -m bench.NAME` (bench/report.py publishes results, bench/flags.py holds the shared flags,
btnode.node.launch starts the nodes)."""
