"""node.memory: sizes as systemd writes them, and the cgroup limit found from /proc/self (a fake one
here: cgroup v1 with a parent's tighter limit, v2's "max", v1's no-limit sentinel), and the environment a
serving node starts in."""

from __future__ import annotations

import pytest

from btnode.aggregate.round.config import AggregatorConfig
from btnode.errors import ConfigError
from btnode.node.memory import TCACHE_TUNABLE, UNLIMITED, cgroup_limit, mmap_threshold, parse_size, server_env


def test_sizes_are_powers_of_1024_as_in_memorymax():
    assert parse_size("4G") == 4 << 30 and parse_size("512m") == 512 << 20 and parse_size("1.5G") == 3 << 29
    assert parse_size("1073741824") == 1 << 30 and parse_size(" 2T ") == 2 << 40
    for bad in ("", "4GB", "-1G", "0", "lots"):
        with pytest.raises(ConfigError, match="--memory-limit takes a size"):
            parse_size(bad)


def fake_proc(tmp_path, cgroup: str, mounts: list[str]):
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "cgroup").write_text(cgroup)
    (proc / "mountinfo").write_text("".join(f"{i} 1 0:{i} {m}\n" for i, m in enumerate(mounts, 30)))
    return proc


def test_v1_takes_the_tightest_of_the_group_and_its_ancestors(tmp_path):
    root = tmp_path / "memory"
    (root / "jobs" / "w0").mkdir(parents=True)
    (root / "memory.limit_in_bytes").write_text(f"{UNLIMITED + 4096}\n")  # v1's "no limit"
    (root / "jobs" / "memory.limit_in_bytes").write_text(f"{6 << 30}\n")
    (root / "jobs" / "w0" / "memory.limit_in_bytes").write_text(f"{8 << 30}\n")
    proc = fake_proc(tmp_path, "4:memory:/jobs/w0\n1:cpu:/\n0::/\n",
                     [f"/ {root} rw,relatime shared:1 - cgroup cgroup rw,memory"])
    got = cgroup_limit(proc)
    assert got is not None and got.bytes == 6 << 30 and got.source == "cgroup memory.limit_in_bytes of /jobs"
    (root / "jobs" / "memory.limit_in_bytes").write_text(f"{UNLIMITED + 4096}\n")
    assert cgroup_limit(proc).bytes == 8 << 30  # type: ignore[union-attr]


def test_v2_reads_memory_max_and_ignores_max(tmp_path):
    root = tmp_path / "unified"
    (root / "system.slice" / "btnode-worker@2.service").mkdir(parents=True)
    (root / "system.slice" / "memory.max").write_text("max\n")
    (root / "system.slice" / "btnode-worker@2.service" / "memory.max").write_text(f"{3 << 30}\n")
    proc = fake_proc(tmp_path, "0::/system.slice/btnode-worker@2.service\n",
                     [f"/ {root} rw,nosuid shared:2 - cgroup2 cgroup2 rw"])
    got = cgroup_limit(proc)
    assert got is not None and got.bytes == 3 << 30 and "memory.max of /system.slice/btnode-worker@2.service" in got.source
    (root / "system.slice" / "btnode-worker@2.service" / "memory.max").write_text("max\n")
    assert cgroup_limit(proc) is None


def test_no_memory_controller_means_no_cgroup_limit(tmp_path):
    proc = fake_proc(tmp_path, "1:cpu:/\n", [f"/ {tmp_path} rw - cgroup cgroup rw,cpu"])
    assert cgroup_limit(proc) is None


def test_serving_nodes_start_with_glibcs_thread_cache_off_and_others_as_they_were():
    agg = server_env(["join", "--role", "aggregator", "--listen", "127.0.0.1:0"], {"PATH": "/bin"})
    assert agg == {"PATH": "/bin", "GLIBC_TUNABLES": f"{TCACHE_TUNABLE}=0"}
    assert server_env(["join", "--role=relay"], {})["GLIBC_TUNABLES"] == f"{TCACHE_TUNABLE}=0"
    other = server_env(["join", "--role", "relay"], {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})
    assert other["GLIBC_TUNABLES"] == f"glibc.malloc.arena_max=2:{TCACHE_TUNABLE}=0"  # its other tunables kept
    mine = {"GLIBC_TUNABLES": f"{TCACHE_TUNABLE}=7"}
    assert server_env(["join", "--role", "aggregator"], mine) == mine  # a setting of its own is left alone
    assert server_env(["join", "--role", "worker"], None) is None and server_env(["plan"], {"A": "1"}) == {"A": "1"}


def test_the_mmap_threshold_is_the_roles_unless_the_flag_sets_it():
    """A relay keeps freed blocks under 4 MiB (its chunks' page faults were most of its CPU), an aggregator
    under 128 KiB (its memory is the aim); --mmap-threshold-kib overrides either, and refuses a negative."""
    assert mmap_threshold("relay") == 4 << 20 and mmap_threshold("aggregator") == 128 << 10
    assert mmap_threshold("aggregator", 4096) == mmap_threshold("relay", 4096) == 4 << 20
    with pytest.raises(ConfigError, match="--mmap-threshold-kib"):
        AggregatorConfig(mmap_threshold_kib=-1)
