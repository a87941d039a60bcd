"""The cheats bench's Watch rows (bench/cheats.py EXTERNAL_ROWS["watch"]): a version stream held under
a foreign id, under an id that never joined, and under a revoked one, against a real gRPC aggregator
with identities as a fresh one has them (rpc/enroll.py: its own CA, each identity enrolled with a
join code, mutual TLS). Such a stream trains nothing; what it can harm is liveness: a registered
replica is one every round waits for until its deadline. Per row: the answer, whether a stream under the id
stayed open (a live replica to the rounds), and for the revoked one how long its open stream outlived the revocation."""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
from pathlib import Path

from btnode.aggregate.round.config import AggregatorConfig
from btnode.aggregate.service import SwarmAggregator
from btnode.errors import PeerInputError
from btnode.model.config import ModelConfig
from btnode.rpc.client import SwarmClient
from btnode.rpc.enroll import SwarmAuthority, enroll, identity_security, serve_enrollment
from btnode.rpc.server import serve
from btnode.train.config import TrainConfig
from btnode.train.terms import TrainingTerms

SHAPE = ModelConfig(d_model=32, n_heads=2, n_layers=1, n_blocks=1, context=32, segments=(1, 8))


def watch_rows(args: argparse.Namespace) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        return _rows(Path(tmp))


def _rows(tmp: Path) -> list[dict]:
    acfg = AggregatorConfig()
    authority = SwarmAuthority.create(tmp / "state")
    agg = SwarmAggregator(SHAPE, acfg, tmp / "state")
    enrollment, _ = serve_enrollment(authority, "127.0.0.1:0")
    server, port, _ = serve(agg, "127.0.0.1:0", security=authority.security())
    address, block = f"127.0.0.1:{port}", agg.block(0)
    clients: dict[str, SwarmClient] = {}
    terms = TrainingTerms(TrainConfig(batch=acfg.claims.batch, lr=acfg.claims.lr), acfg.claims.steps_per_round).to_json()
    try:
        for name in ("honest", "mallory", "stranger", "eve"):
            code, _ = authority.mint(name=name, host="127.0.0.1")
            enroll(code, tmp / name)
            clients[name] = SwarmClient(address, timeout_s=10, security=identity_security(tmp / name))
        for name in ("honest", "mallory", "eve"):
            clients[name].join(name, 0, SHAPE.fingerprint(), json.dumps(SHAPE.to_dict()), training_json=terms)
        before = block.info.sha256
        # another identity's id: a joined identity doing so is revoked (SwarmAggregator.admit); one that never
        # joined is refused only (an honest worker's stream reconnecting to a restarted aggregator looks the same)
        rows = [_attempt("watch_foreign", clients["mallory"], "honest", block, agg, "mallory"),
                _attempt("watch_never_joined", clients["stranger"], "stranger", block, agg, "stranger")]
        rows.append(_revoked(clients["eve"], SwarmClient(address, timeout_s=10,
                                                         security=identity_security(authority.operator)), block, agg))
        assert block.info.sha256 == before  # no row trains: the model cannot move
        return rows
    finally:
        for c in clients.values():
            c.close()
        server.stop(0).wait()
        enrollment.stop(0).wait()


def _row(cheat: str, refused: str, held: bool, **extra: object) -> dict:
    """`held`: a version stream under the id is open at the aggregator after the attempt (the rounds
    would count it as a live replica)."""
    return {"cheat": cheat, "mode": "default", "delta_ce": 0.0, "peak_delta_ce": 0.0,
            "caught_round": 0 if refused else None, "revoked": extra.pop("revoked", False), "refused": refused,
            "stream_held": held, "honest_flagged": 0, **extra}


def _attempt(cheat: str, client: SwarmClient, worker_id: str, block, agg: SwarmAggregator,  # type: ignore[no-untyped-def]
             who: str) -> dict:
    """`who`: the name `client`'s certificate proves."""
    try:
        next(iter(client.watch(0, worker_id)))
        refused = ""
    except PeerInputError as exc:
        refused = exc.reason
    return _row(cheat, refused, worker_id in block.streams, revoked=agg.identities.is_revoked(who))


def _revoked(client: SwarmClient, operator: SwarmClient, block, agg: SwarmAggregator) -> dict:  # type: ignore[no-untyped-def]
    stream = client.watch(0, "eve")
    next(stream)
    held = "eve" in block.streams
    ended = threading.Event()

    def drain() -> None:
        try:
            for _ in stream:
                pass
        except Exception:  # noqa: BLE001 - its end is what is measured
            pass
        ended.set()

    threading.Thread(target=drain, daemon=True).start()
    t0 = time.perf_counter()
    operator.revoke("eve")
    ended.wait(10)
    took = time.perf_counter() - t0
    again = _attempt("watch_revoked", client, "eve", block, agg, "eve")
    operator.close()
    return _row("watch_revoked", again["refused"], "eve" in block.streams, revoked=agg.identities.is_revoked("eve"),
                held_before=held, stream_end_s=round(took, 3) if ended.is_set() else None,
                replica_after="eve" in block.registered)
