"""A relay's open round, durable (docs/swarm.md, "Relays"): each accepted child update's raw codec
bytes go to a named spill and its judged record (header fields, weight, norm, where its bytes are,
its frames digest) to a log, both fsynced before the child is told ACCEPTED. A relay killed
mid-round and restarted on the same state folder takes the round up again while the parent is still
on its version, and forwards it: an update whose worker died with the relay is not lost with it.

The log is JSON lines: first {"version", "opened_at"}, then one record per accepted update. A torn
last line (a crash while it was written) is dropped: its child was never told ACCEPTED."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from btnode.aggregate.round.rounds import Update
from btnode.aggregate.sums.spill import Spill
from btnode.codec.codecs import Codec
from btnode.durable import atomic_write
from btnode.protocol import ManifestEntry

log = logging.getLogger(__name__)

LOG_NAME, SPILL_NAME = "relay-round.jsonl", "relay-round.spill"
FIELDS = ("worker_id", "update_id", "base_version", "samples", "loss", "weight", "norm", "scale")


@dataclass(frozen=True)
class Receipt:
    """What a child update came with that its manifest entry carries (relay.manifest_of)."""

    samples: float = 0.0  # its own weight claim
    cert: bytes = b""  # under mutual TLS: its certificate and signature over its push receipt
    signature: bytes = b""
    claim_sha256: str = ""  # protocol.claim_digest of its work claim, which that signature covers
    token: bytes = b""  # under a root that replays audits: the root's commit token (aggregate/trust/commits.py)


@dataclass
class Recovered:
    opened_at: float
    updates: list[tuple[Update, str]]  # each accepted update (its bytes in the spill) and its frames digest
    spill: Spill
    receipts: dict[str, Receipt] = field(default_factory=dict)  # update id → what it came with


def _jsonable(v: object) -> object:
    return {"hex": v.hex()} if isinstance(v, bytes) else v


def _unjson(v: object) -> object:
    return bytes.fromhex(v["hex"]) if isinstance(v, dict) and set(v) == {"hex"} else v


def _record(u: Update, digest: str) -> dict:
    return {**{f: getattr(u, f) for f in FIELDS}, "codec": u.codec.name, "spilled": u.spilled, "digest": digest,
            "manifest": [{k: _jsonable(v) for k, v in dataclasses.asdict(e).items()} for e in u.manifest]}


def _update(r: dict) -> tuple[Update, str]:
    manifest = tuple(ManifestEntry(**{k: _unjson(v) for k, v in e.items()}) for e in r["manifest"])
    u = Update(**{f: r[f] for f in FIELDS}, delta=None, codec=Codec[r["codec"]],
               spilled={n: (int(o), int(ln)) for n, (o, ln) in r["spilled"].items()}, manifest=manifest)
    return u, r["digest"]


def _receipt(r: dict | list) -> Receipt:
    if isinstance(r, list):  # an earlier relay's log: samples, certificate, signature
        return Receipt(float(r[0]), bytes.fromhex(r[1]), bytes.fromhex(r[2]))
    return Receipt(**{k: _unjson(v) for k, v in r.items()})  # type: ignore[arg-type]


class RoundLog:
    """The open round's log and spill in `folder`."""

    def __init__(self, folder: Path):
        self.folder = folder
        self._file = None

    def start(self, version: int, opened_at: float) -> Spill:
        """A new round: empty log (its first line) and spill."""
        self.close()
        spill = Spill(self.folder, name=SPILL_NAME)
        self._file = open(self.folder / LOG_NAME, "wb")  # noqa: SIM115 - kept open for the round
        self._append({"version": version, "opened_at": opened_at})
        return spill

    def accepted(self, u: Update, digest: str, spill: Spill, receipt: Receipt | None = None) -> None:
        """Durable before its child hears ACCEPTED: its bytes, then its record (with what its manifest
        entry carries: its weight claim, and its signed receipt and commit token when it has them)."""
        spill.sync()
        record = _record(u, digest)
        if receipt is not None:
            record["receipt"] = {k: _jsonable(v) for k, v in dataclasses.asdict(receipt).items()}
        self._append(record)

    def recover(self, version: int) -> Recovered | None:
        """The round the log holds, if it is on `version`; None (nothing to take up) otherwise."""
        path = self.folder / LOG_NAME
        if not path.exists() or not (self.folder / SPILL_NAME).exists():
            return None
        lines = path.read_bytes().splitlines()
        try:
            head = json.loads(lines[0])
        except (IndexError, ValueError):
            return None
        if head.get("version") != version:
            log.info("the round log in %s is for version %s, not %d: nothing to take up", self.folder,
                     head.get("version"), version)
            return None
        updates, receipts = [], {}
        for i, line in enumerate(lines[1:], start=2):
            try:
                record = json.loads(line)
                updates.append(_update(record))
                if "receipt" in record:
                    receipts[record["update_id"]] = _receipt(record["receipt"])
            except (ValueError, KeyError, TypeError) as exc:
                if i != len(lines):
                    raise ValueError(f"{path}: line {i}: {exc}") from exc
                atomic_write(path, b"".join(x + b"\n" for x in lines[:-1]))  # torn: its child was never answered
        spill = Spill(self.folder, name=SPILL_NAME, reopen=True)
        self._file = open(path, "ab")  # noqa: SIM115 - kept open for the round
        return Recovered(opened_at=float(head["opened_at"]), updates=updates, spill=spill, receipts=receipts)

    def _append(self, doc: dict) -> None:
        assert self._file is not None
        self._file.write(json.dumps(doc, separators=(",", ":")).encode() + b"\n")
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
