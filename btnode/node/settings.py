"""Node settings that no library component owns and several roles share: where a node serves
(ServeConfig: the aggregator and a stage) and what this host computes on and reads (HostConfig)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from btnode.data import DEFAULT_CACHE_GB
from btnode.settings import flag

if TYPE_CHECKING:
    from btnode.data.corpus import Corpus


@dataclass(frozen=True)
class ServeConfig:
    """A node that serves gRPC (local: each node its own)."""

    listen: str = flag("--listen", "HOST:PORT to serve on (port 0 picks one).", default="0.0.0.0:7070")
    port_file: Path | None = flag("--port-file", "Write the bound port here once serving.", default=None)
    metrics_listen: str | None = flag("--metrics-listen", "HOST:PORT to serve Prometheus /metrics on (default: off).",
                                      default=None)
    drain_notice: float = flag("--drain-notice", "Seconds between gRPC Health turning NOT_SERVING on SIGTERM and the "
                                                 "server refusing new calls (time for probes and load balancers to "
                                                 "notice).", default=0.0, min=0.0)


@dataclass(frozen=True)
class HostConfig:
    """The torch device and the corpus of this process (local)."""

    device: str = flag("--device", "Torch device: cpu, cuda or cuda:N.", default="cpu", param="device_name")
    data: str | None = flag("--data", "Data: a prepared dataset (a folder with manifest.json, or its http(s):// URL), "
                                      "a folder with wiki.{train,valid,test}.raw, or one file (the training corpus; "
                                      "tune and test stay bundled). Default: the bundled WikiText-2 copy.", default=None)
    data_cache: Path | None = flag("--data-cache", "Where a dataset URL's shards are kept (default: "
                                                   "$XDG_CACHE_HOME/btnode/data, else ~/.cache/btnode/data).",
                                   default=None)
    data_cache_gb: float = flag("--data-cache-gb", "Disk a dataset URL's shard cache may use, in GB (least recently "
                                                   "used shards are evicted).", default=DEFAULT_CACHE_GB, min=0.0)

    def load_corpus(self) -> Corpus:
        """The corpus `--data` names, a URL's shards cached as the cache flags say (corpus is imported
        here: it brings torch, which a command's --help does not need)."""
        from btnode.data import corpus

        return corpus.load(self.data, cache_dir=self.data_cache, cache_gb=self.data_cache_gb)
