"""Metrics that need no torch: `btnode_build_info`, which every role's scrape starts with, and the
HTTP API's collector (the API in front of a remote chain must stay light: node/api.py). The other
roles' collectors are in node/metrics.py."""

from __future__ import annotations

import platform
import sys
from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, SummaryMetricFamily
from prometheus_client.registry import Collector

from btnode import __version__
from btnode.meter import Meter

Family = CounterMetricFamily | GaugeMetricFamily | SummaryMetricFamily | InfoMetricFamily


def build_info(role: str) -> Family:
    """`btnode_build_info{version,role,python,torch} 1`, first in every role's scrape: which build a node
    runs is the first question about a swarm of mixed hosts, and a label is where a dashboard can
    group by it (`count by (version) (btnode_build_info)`)."""
    info = InfoMetricFamily("btnode_build", "Version of btnode and of what it runs on.")
    torch = sys.modules.get("torch")  # not loaded by the HTTP proxy, which must stay light
    info.add_metric([], {"version": __version__, "role": role, "python": platform.python_version(),
                         "torch": torch.__version__ if torch is not None else "none"})
    return info


class ApiCollector(Collector):
    """The HTTP API in front of a chain (node/api.py): answers by route and status code, requests in
    flight, time to the first segment, streams cancelled by their client."""

    ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/models/{id}", "/health", "/", "/metrics",
              "other")

    def __init__(self, meter: Meter, in_flight: Callable[[], int],
                 model: Callable[[], dict[str, str] | None] = lambda: None):
        self.meter = meter
        self.in_flight = in_flight
        self.model = model

    def collect(self) -> Iterator[Family]:
        yield build_info("api")
        if (labels := self.model()) is not None:  # once the chain has been read
            info = InfoMetricFamily("btnode_api_model", "The model served: its id, version and weights' hash.")
            info.add_metric([], labels)
            yield info
        counts, durations = self.meter.snapshot()
        requests = CounterMetricFamily("btnode_api_requests", "HTTP answers by route and status code.",
                                       labels=["route", "code"])
        for route in self.ROUTES[:2]:  # present from the start, at 0
            if not any(k[0] == "http" and k[1] == route for k in counts):
                requests.add_metric([route, "200"], 0)
        for key, n in sorted(counts.items()):
            if key[0] == "http":
                requests.add_metric([key[1], key[2]], n)
        yield requests
        yield GaugeMetricFamily("btnode_api_in_flight", "Generation requests being served now.",
                                value=self.in_flight())
        cancelled = CounterMetricFamily("btnode_api_cancelled", "Streams whose client went away before the end "
                                        "(cancelled down the chain).")
        cancelled.add_metric([], counts.get(("cancelled",), 0))
        yield cancelled
        count, total = durations.get("ttfb", (0, 0.0))
        yield SummaryMetricFamily("btnode_api_ttfb_seconds", "Time from a request's arrival to its first segment "
                                  "from the chain.", count_value=count, sum_value=total)
