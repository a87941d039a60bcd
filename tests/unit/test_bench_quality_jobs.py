"""bench/quality.py --jobs: training runs side by side, each child with its share of the cores."""

import sys
import threading

from bench import quality
from bench.report import measure


def test_runs_go_costliest_first_one_at_a_time_by_default():
    order = []
    jobs = {name: (cost, lambda name=name: order.append(name) or {"name": name})
            for name, cost in (("small", 1.0), ("large", 9.0), ("mid", 3.0))}
    runs = quality.run_jobs(jobs, 1)
    assert order == ["large", "mid", "small"]
    assert runs == {n: {"name": n} for n in ("large", "mid", "small")}


def test_two_jobs_run_side_by_side():
    """Each of two runs waits until the other has started: one at a time, they would never both pass."""
    both = threading.Barrier(2, timeout=10)
    jobs = {name: (1.0, lambda name=name: {"name": name, "met": both.wait() is not None}) for name in ("a", "b")}
    runs = quality.run_jobs(jobs, 2)
    assert runs == {"a": {"name": "a", "met": True}, "b": {"name": "b", "met": True}}


def test_a_child_gets_its_thread_count(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    cmd = [sys.executable, "-c", "import os; print(os.environ.get('OMP_NUM_THREADS'), os.environ.get('MKL_NUM_THREADS'))"]
    assert measure(cmd, threads=1).stdout.split() == ["1", "1"]
    assert measure(cmd).stdout.split() == ["None", "None"]  # without `threads`, the child's environment is ours
