"""Node settings that no library component owns and several roles share: where a node serves
(ServeConfig: the aggregator and a stage) and what this host computes on and reads (HostConfig)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from btnode.settings import flag


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
    data: Path | None = flag("--data", "Corpus: a file (training corpus) or a folder with wiki.{train,valid,test}.raw. "
                                       "Default: the bundled WikiText-2 copy.", default=None)
