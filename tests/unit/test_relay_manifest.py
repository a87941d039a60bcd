"""A relay's manifest (aggregate/relay/forward.py): one entry per kept child update, flattened through child
relays with their staleness factor, and a digest that names the child's frames whatever their order."""

from __future__ import annotations

import hashlib

from btnode.aggregate.trust.evidence import frames_digest
from btnode.aggregate.relay.forward import manifest_of
from btnode.aggregate.round.rounds import Update
from btnode.protocol import ManifestEntry


def _update(worker: str, weight: float, samples: float, manifest: tuple[ManifestEntry, ...] = ()) -> Update:
    return Update(worker_id=worker, update_id=f"{worker}-u", base_version=3, samples=samples, loss=1.0, delta=None,
                  weight=weight, manifest=manifest)


def test_a_worker_update_is_one_entry_with_its_weight_and_digest():
    (e,) = manifest_of(_update("w1", 8.0, 8.0), "ab" * 32)
    assert (e.worker_id, e.update_id, e.base_version, e.weight, e.sha256) == ("w1", "w1-u", 3, 8.0, "ab" * 32)


def test_a_child_relay_is_flattened_into_its_workers_scaled_by_its_staleness_factor():
    inner = (ManifestEntry("w1", "a", 3, 8.0, "00" * 32), ManifestEntry("w2", "b", 2, 4.0, "11" * 32))
    # the child relay's combined update weighs 12 (8 + 4), taken here at half weight (one version stale)
    out = manifest_of(_update("relay-x", 6.0, 12.0, inner), "")
    assert [(e.worker_id, e.update_id, e.weight, e.sha256) for e in out] == [("w1", "a", 4.0, "00" * 32),
                                                                           ("w2", "b", 2.0, "11" * 32)]
    assert sum(e.weight for e in out) == 6.0  # what the root's sum check compares with the push's weight


def test_the_digest_follows_names_and_frame_hashes_not_arrival_order():
    a, b = hashlib.sha256(b"a").digest(), hashlib.sha256(b"b").digest()
    assert frames_digest({"x": a, "y": b}) == frames_digest({"y": b, "x": a})
    assert frames_digest({"x": a, "y": b}) != frames_digest({"x": b, "y": a})
