"""How much memory this process may use (the smallest of --memory-limit, its cgroup's limit and
MemAvailable) and the worker's admission check against `btnode plan`'s estimate, run before the
worker builds, pulls or trains anything: a worker that cannot fit is refused with one line instead
of being killed by the kernel mid-run (issue #12, item 4)."""

from __future__ import annotations

import ctypes
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

from btnode.codec.codecs import Codec
from btnode.errors import ConfigError, InsufficientMemory
from btnode.model.config import ModelConfig

log = logging.getLogger(__name__)

# cgroup v1 writes "no limit" as PAGE_COUNTER_MAX pages (9223372036854771712 with 4 KiB pages), v2 as
# "max"; anything from 2^62 up is that sentinel, not a limit.
UNLIMITED = 1 << 62
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8  # mallopt's parameters (malloc.h)
ARENAS = 2  # glibc heaps shared by a node's threads (its default: 8 per core)
# glibc's per-thread cache of freed small blocks (up to 7 of each size to 1 KiB), off in serving nodes: with a
# server thread per version stream and per waiting transfer, those caches held a large share of the root's
# peak with a thousand simulated workers (bench/conn_memory.py, setting tcache-off). glibc reads it at
# process start only (no mallopt), so it goes in the environment.
TCACHE_TUNABLE = "glibc.malloc.tcache_count"
# glibc's mmap threshold: blocks from this size up are mmapped when allocated and unmapped when freed. An
# aggregator keeps 128 KiB, so that a close's temporaries leave its RSS (`return_freed_memory`). A relay
# takes 4 MiB: every 1 MiB chunk it receives or serves, and each tensor of a small block, was otherwise
# fresh pages (a page fault per 4 KiB, zeroed by the kernel), and the kernel took most of a relay's CPU
# (perf, one relay of 64 children at d = 256). 4 MiB cut a relay's CPU by about a third for a few percent
# more peak RSS (bench/scale.py at --d-model 256; docs/research.md, "a relay's CPU").
AGGREGATOR_MMAP_THRESHOLD, RELAY_MMAP_THRESHOLD = 128 << 10, 4 << 20
SERVER_ROLES = ("aggregator", "relay")
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


@dataclass(frozen=True)
class MemoryLimit:
    """A ceiling on this process's memory and where it comes from (for the refusal line)."""

    bytes: int
    source: str


def parse_size(text: str) -> int:
    """Bytes of "4G", "512M", "1.5G" or "1073741824": K, M, G, T are powers of 1024, as in
    systemd's MemoryMax=."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)\s*", text.upper())
    if m is None or float(m.group(1)) <= 0:
        raise ConfigError(f"--memory-limit takes a size like 4G, 512M or a byte count, got {text!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB"


def _mounts(mountinfo: Path) -> list[tuple[str, str, str, set[str]]]:
    """(root, mount point, fstype, super options) of each cgroup mount in /proc/self/mountinfo."""
    out = []
    for line in mountinfo.read_text().splitlines():
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) >= 5 and len(tail) >= 3 and tail[0] in ("cgroup", "cgroup2"):
            out.append((fields[3], fields[4], tail[0], set(tail[2].split(","))))
    return out


def _read_limit(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max" or not text.isdigit() or int(text) >= UNLIMITED:
        return None
    return int(text)


def cgroup_limit(proc: Path = Path("/proc/self")) -> MemoryLimit | None:
    """The tightest memory limit on this process's cgroup and its ancestors (a parent's limit binds
    its children too): v1 memory.limit_in_bytes, or v2 memory.max. None when no limit is set or
    no memory controller is mounted."""
    try:
        groups = [line.split(":", 2) for line in (proc / "cgroup").read_text().splitlines()]
        mounts = _mounts(proc / "mountinfo")
    except OSError:
        return None
    best: MemoryLimit | None = None
    for _, controllers, path in (g for g in groups if len(g) == 3):
        v1 = "memory" in controllers.split(",")
        if not v1 and controllers != "":
            continue
        fstype, fname = ("cgroup", "memory.limit_in_bytes") if v1 else ("cgroup2", "memory.max")
        for root, point, kind, opts in mounts:
            if kind != fstype or (v1 and "memory" not in opts):
                continue
            rel = path[len(root):] if root != "/" and path.startswith(root) else path
            here = Path(point) / rel.lstrip("/")
            while True:  # this group, then each ancestor up to the mount point
                n = _read_limit(here / fname)
                if n is not None and (best is None or n < best.bytes):
                    shown = "/" if here == Path(point) else f"/{here.relative_to(point)}"
                    best = MemoryLimit(n, f"cgroup {fname} of {shown}")
                if here == Path(point) or here.parent == here:
                    break
                here = here.parent
            break
    return best


def available(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """MemAvailable in bytes (what the kernel could give without swapping), or None off Linux."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def setting(text: str) -> MemoryLimit:
    """--memory-limit TEXT as a limit that names itself."""
    return MemoryLimit(parse_size(text), f"--memory-limit {text.strip()}")


def host_limit(setting: MemoryLimit | None, *, held: int = 0) -> MemoryLimit | None:
    """The smallest of --memory-limit, the cgroup's limit and MemAvailable. MemAvailable counts what
    is free now, so what this process already holds (`held`, its resident set) is added back: the
    estimate it is compared with includes this process's runtime."""
    limits = [setting] if setting is not None else []
    limits.append(cgroup_limit() or MemoryLimit(UNLIMITED, "no limit"))
    free = available()
    if free is not None:
        limits.append(MemoryLimit(free + held, "MemAvailable + this process's resident set"))
    best = min(limits, key=lambda m: m.bytes)
    return None if best.bytes >= UNLIMITED else best


def check_worker(cfg: ModelConfig, *, block: int, batch: int, codec: Codec, setting: MemoryLimit | None) -> int:
    """Refuse (InsufficientMemory) a worker whose predicted peak (plan.swarm_worker_peak_bytes: plan's
    training peak of its unit plus the swarm worker's own copies) exceeds what this host allows;
    returns the predicted bytes. Probes small real steps at the real width (seconds at most), and
    builds nothing of full size."""
    from btnode.train.plan import ar_memory, block_memory, resident_bytes, swarm_worker_peak_bytes

    what = (f"a --model ar worker (the {cfg.ar_layers}-layer AR model)" if cfg.kind == "ar"
            else f"a worker for block {block}")
    unit = ar_memory(cfg, batch, cfg.ar_layers) if cfg.kind == "ar" else block_memory(cfg, batch)
    need = swarm_worker_peak_bytes(unit, codec)
    limit = host_limit(setting, held=resident_bytes())
    if limit is None or need <= limit.bytes:
        log.info("memory check: %s needs ~%s at batch %d (btnode plan); this host allows %s",
                 what, gb(need), batch, f"{gb(limit.bytes)} ({limit.source})" if limit else "no limit")
        return need
    fix = ("train one block instead (--model block), lower --batch or raise the limit" if cfg.kind == "ar"
           else "lower --batch, use a smaller --d-model or more --blocks, or raise the limit")
    raise InsufficientMemory(f"{what} needs ~{gb(need)} at batch {batch} ({unit.parameters / 1e6:,.1f} M parameters; "
                             f"btnode plan), this host allows {gb(limit.bytes)} ({limit.source}); {fix}")


def server_env(args: list[str] | tuple[str, ...], env: dict[str, str] | None) -> dict[str, str] | None:
    """The environment to start `btnode ARGS` in: for an aggregator or a relay (`--role aggregator`,
    `--role relay`), `env` (or this process's) with glibc's thread cache off (TCACHE_TUNABLE=0) unless
    GLIBC_TUNABLES already sets it; for any other command, `env` as it was."""
    role = next((b for a, b in zip(args, args[1:]) if a == "--role"), "") or next(
        (a.split("=", 1)[1] for a in args if a.startswith("--role=")), "")
    if role not in SERVER_ROLES:
        return env
    out = dict(os.environ if env is None else env)
    tunables = out.get("GLIBC_TUNABLES", "")
    if TCACHE_TUNABLE + "=" not in tunables:
        out["GLIBC_TUNABLES"] = ":".join(t for t in (tunables, f"{TCACHE_TUNABLE}=0") if t)
    return out


def mmap_threshold(role: str, kib: int = 0) -> int:
    """The mmap threshold in bytes a serving node sets: `--mmap-threshold-kib` when given (not 0),
    otherwise its role's (RELAY_MMAP_THRESHOLD for a relay, AGGREGATOR_MMAP_THRESHOLD else)."""
    return kib << 10 if kib else RELAY_MMAP_THRESHOLD if role == "relay" else AGGREGATOR_MMAP_THRESHOLD


def return_freed_memory(mmap_threshold: int = AGGREGATOR_MMAP_THRESHOLD) -> bool:
    """Make glibc hand large freed blocks back to the kernel, and keep fewer heaps (issue #25). By
    default glibc raises its mmap threshold each time a large block is freed (up to 32 MiB), after
    which tensors of that size come from the heap and their pages stay with the process when freed:
    an aggregator's RSS then stays at the peak of its largest close for good. A fixed 128 KiB
    threshold keeps every tensor above it mmapped, so freeing it returns its pages. And glibc gives
    threads their own heaps (arenas, up to 8 per core), each keeping what was freed in it: with a
    server thread per connected worker, fewer of them lowered the root's peak RSS (bench/scale.py with
    MALLOC_ARENA_MAX=2; docs/research.md).
    Call it before the server's threads start, with `mmap_threshold(role, kib)`. True if set (glibc only)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        return (bool(libc.mallopt(M_MMAP_THRESHOLD, mmap_threshold)) and bool(libc.mallopt(M_TRIM_THRESHOLD, 128 * 1024))
                and bool(libc.mallopt(M_ARENA_MAX, ARENAS)))
    except (OSError, AttributeError):
        return False
