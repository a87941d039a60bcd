"""A relay passes its children's joins on to its parent a few at a time: the parent's calls share one
small budget over all its peers (rpc/limits.py), which a relay passing on a swarm's joins at once
would fill."""

from __future__ import annotations

import json
import threading
import time

from btnode.aggregate.round.config import AggregatorConfig
from btnode.aggregate.relay.admission import UPSTREAM_JOINS
from btnode.aggregate.service import relay_swarm
from btnode.aggregate.service import SwarmAggregator
from btnode.model.config import ModelConfig

from procs import honest_terms

CFG = ModelConfig(d_model=32, n_heads=2, n_layers=1, n_blocks=1, context=32, segments=(1,))


class CountingParent:
    """An in-process parent (a real SwarmAggregator) that notes how many joins it serves at once."""

    def __init__(self, root: SwarmAggregator):
        self.root, self.lock = root, threading.Lock()
        self.now = self.most = 0

    def join(self, worker_id, block, fingerprint, config_json, data_id="", *, training_json="", relay=False,
             proof=None):
        with self.lock:
            self.now += 1
            self.most = max(self.most, self.now)
        try:
            time.sleep(0.2)  # a join's round trip: long enough for the others to pile up
            return self.root.join(worker_id, block, fingerprint, config_json, data_id, training_json=training_json)
        finally:
            with self.lock:
                self.now -= 1

    def leave(self, worker_id, block):
        self.root.leave(worker_id, block)


def test_a_relay_passes_on_its_childrens_joins_a_few_at_a_time(tmp_path):
    parent = CountingParent(SwarmAggregator(CFG, AggregatorConfig(), tmp_path / "root"))
    relay = relay_swarm(CFG, AggregatorConfig(), tmp_path / "relay", upstream=parent, name="r1", blocks=[0])
    children = [f"w{i}" for i in range(4 * UPSTREAM_JOINS)]
    threads = [threading.Thread(target=relay.join, args=(w, 0, CFG.fingerprint(), json.dumps(CFG.to_dict())),
                                kwargs={"training_json": honest_terms()}) for w in children]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert parent.most == UPSTREAM_JOINS  # never more at once, and the limit was reached
    assert set(children) <= parent.root.blocks[0].registered and set(children) <= relay.blocks[0].registered
