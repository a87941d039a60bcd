"""`Identities`: who is talking, once the transport proved it (mutual TLS: the client certificate
the swarm CA signed, docs/security.md). The aggregator binds every claim to that identity: a
worker id must be the certificate's name, a push needs a join of that block, one identity pushes
one update per round, and a revoked name is refused from then on. Each identity keeps a record
for `btnode status`. Without mutual TLS there are no identities and worker ids stay claims.

Revocations are written durably to the state folder, so a restarted aggregator keeps them.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

from btnode.errors import CheckpointError, Forbidden, InputError, Refused
from btnode.aggregate.trust.standing import UNWEIGHTED  # kept, weighing 0: not its own drop
from btnode.protocol import INCOMPLETE, MAX_NAME, PushHeader
from btnode.durable import atomic_write

REVOKED_FILE = "revoked.json"


class Role(str, Enum):
    """What a certificate may do: workers, relays and stages push and pull; an operator reads status
    and revokes. A certificate without a btnode role (made by hand with openssl) is a worker."""

    WORKER = "worker"
    RELAY = "relay"
    STAGE = "stage"
    OPERATOR = "operator"
    AGGREGATOR = "aggregator"  # a server certificate; as a client it may only read status


SWARM_ROLES = frozenset({Role.WORKER, Role.RELAY, Role.STAGE})  # may join, pull, push, watch, leave


@dataclass(frozen=True)
class Identity:
    """A peer as its certificate names it; `fingerprint` (sha256 of the certificate, hex) tells two
    certificates of one name apart in logs and status."""

    name: str
    role: Role
    fingerprint: str

    def passes_on(self, header: PushHeader) -> bool:
        """Whether this peer, a relay, sends a child's own update (or its start state) in the child's
        name: one its parent drew for a replay audit."""
        return self.role is Role.RELAY and not header.manifest and header.worker_id != self.name


# Under mutual TLS: the swarm CA's check of a certificate (PEM) and its signature over a statement, for
# a name (rpc/certs.verify_signed); the proven identity, or Forbidden. rpc/ hands it in: no crypto here.
Verify = Callable[[bytes, bytes, bytes, str], Identity]


@dataclass
class IdentityRecord:
    """What one identity did since the aggregator started (revocation survives restarts).
    `audited` and `failed` count audits of its updates: 0 until audits exist. Of its updates taken
    into a round (`accepted`: answered PENDING, or admitted after probation), each ends `applied` or
    `dropped` (its receipt), the drops by reason."""

    name: str
    role: str = ""
    fingerprint: str = ""
    joined: set[int] = field(default_factory=set)
    accepted: int = 0
    refused: Counter = field(default_factory=Counter)  # reason → pushes or calls refused
    audited: int = 0
    failed: int = 0
    revoked_at: float | None = None  # unix time
    applied: int = 0
    dropped: Counter = field(default_factory=Counter)  # reason → its updates dropped from their round
    verified: int = 0  # others' rounds it replayed whose verdict its attestation agreed with (delegated verification)
    verify_s: float = 0.0  # ... and the seconds of all the replays it attested (its metered verifier work)

    @property
    def screened_out(self) -> int:
        """Its updates the robust screen dropped at a round's close (reasons `*_at_close`): what says an
        identity's updates keep disagreeing with the swarm's, as opposed to drops by revocation or an
        audit (which revoke it anyway) or by an audit that finished after its round (the aggregator's pace)."""
        return sum(n for reason, n in self.dropped.items() if reason.endswith(SCREEN_SUFFIX) and reason != UNWEIGHTED)


SCREEN_SUFFIX = "_at_close"  # the robust screen's drop reasons (aggregate/round/screen.py): norm_at_close, ...


class Identities:
    def __init__(self, state_dir: Path, *, clock=time.time):
        self.path = state_dir / REVOKED_FILE
        self.clock = clock
        self._lock = threading.Lock()
        self._records: dict[str, IdentityRecord] = {}
        self._last_push: dict[tuple[str, int], tuple[int, str]] = {}  # (name, block) → (base version, update id)
        self._judged: dict[tuple[str, int], tuple[int, str]] = {}  # the same, for the last update on its record
        self.revoked: dict[str, float] = self._read()  # name → unix time of its revocation
        for name, at in self.revoked.items():
            self._records[name] = IdentityRecord(name=name, revoked_at=at)

    def _record(self, who: Identity) -> IdentityRecord:
        rec = self._records.setdefault(who.name, IdentityRecord(name=who.name))
        rec.role, rec.fingerprint = who.role.value, who.fingerprint
        return rec

    def admit(self, who: Identity, method: str, claimed: str = "") -> None:
        """Refuse the call (Forbidden) from a revoked name, a role not allowed `method`, or a
        worker id claimed that is not the certificate's name. `method`: the RPC's name."""
        with self._lock:
            rec = self._record(who)
            if who.name in self.revoked:
                self._refuse(rec, Forbidden("revoked", f"identity {who.name!r} was revoked by the swarm operator"))
            if method == "Revoke" and who.role is not Role.OPERATOR:
                self._refuse(rec, Forbidden("role", f"{who.name!r} is a {who.role.value}; only an operator may revoke"))
            if method not in ("Status", "Revoke") and who.role not in SWARM_ROLES:
                self._refuse(rec, Forbidden("role", f"{who.name!r} is a {who.role.value}; it may not call {method}"))
            if claimed and claimed != who.name:
                self._refuse(rec, Forbidden("name", f"the certificate names {who.name!r}, but the call claims worker "
                                                    f"id {claimed!r}"))

    def _refuse(self, rec: IdentityRecord, exc: Forbidden | Refused) -> None:
        rec.refused[exc.reason] += 1
        raise exc

    def impersonates(self, who: Identity, method: str, claimed: str) -> bool:
        """Whether this call is one identity acting under another's worker id after it joined under its
        own: a joined node is configured right (its id is its certificate's name), so a Watch, Push or
        other call of it in another name is no mistake. A Join under another name may be one: refused only."""
        with self._lock:
            rec = self._records.get(who.name)
            return (bool(claimed) and claimed != who.name and method not in ("Join", "Status", "Revoke")
                    and rec is not None and bool(rec.joined))

    def joined(self, who: Identity, block: int) -> None:
        with self._lock:
            self._record(who).joined.add(block)

    def check_push(self, who: Identity, header: PushHeader, ever_joined: bool) -> None:
        """A push needs a join of its block (`ever_joined`: the block's data keys name it, so this
        survives an aggregator restart), and one identity pushes one update per base version: a
        re-push of the same update id is a retry and passes (the block answers it as before)."""
        with self._lock:
            rec = self._record(who)
            if not ever_joined:
                self._refuse(rec, Refused("not_joined", f"{who.name!r} pushed to block {header.block} without "
                                                        f"joining it"))
            key = (who.name, header.block)
            last = self._last_push.get(key)
            # a relay may amend its combined update (it takes the place of the last: aggregate/round/block.py)
            if last is not None and last[0] == header.base_version and last[1] != header.update_id and not header.manifest:
                self._refuse(rec, Refused("second_push", f"{who.name!r} already pushed update {last[1][:8]} based "
                                                         f"on version {header.base_version} of block {header.block}"))
            self._last_push[key] = (header.base_version, header.update_id)

    def judged(self, who: Identity, header: PushHeader, accepted: bool, reason: str) -> None:
        """Record the outcome of one of its pushes (`reason`: why it was not accepted), once per
        update: a retry of an update already judged is answered as before, not counted again."""
        with self._lock:
            key = (who.name, header.block)
            if self._judged.get(key) == (header.base_version, header.update_id):
                return
            rec = self._record(who)
            if accepted:
                rec.accepted += 1
            else:
                rec.refused[reason or "refused"] += 1
            if reason not in INCOMPLETE:  # an update that did not arrive whole may come again
                self._judged[key] = (header.base_version, header.update_id)

    def audited(self, name: str, passed: bool) -> None:
        """Put an audit of one of `name`'s updates on its record (a worker id's, without mutual TLS)."""
        with self._lock:
            rec = self._records.setdefault(name, IdentityRecord(name=name))
            rec.audited += 1
            rec.failed += not passed

    def settled(self, name: str, applied: bool, reason: str = "") -> None:
        """Put the receipt of one of `name`'s updates on its record: applied, or dropped with `reason`
        (a worker id's, without mutual TLS, as `audited`)."""
        with self._lock:
            rec = self._records.setdefault(name, IdentityRecord(name=name))
            if applied:
                rec.applied += 1
            else:
                rec.dropped[reason or "dropped"] += 1

    def drops(self, name: str) -> int:
        """How many of `name`'s updates the robust screen dropped at close since this aggregator started
        (IdentityRecord.screened_out; 0 for a name never seen): what weighs against an identity."""
        with self._lock:
            rec = self._records.get(name)
            return rec.screened_out if rec is not None else 0

    def is_revoked(self, name: str) -> bool:
        with self._lock:
            return name in self.revoked

    def revoke(self, name: str, *, seen_only: bool = True) -> float:
        """Refuse `name` from now on (durably); returns the time of its revocation. An operator may
        revoke only names this aggregator has seen (`seen_only`): a typo must not pass for a revocation."""
        if not name or len(name) > MAX_NAME:
            raise InputError(f"an identity name has 1 to {MAX_NAME} characters, got {len(name)}")
        with self._lock:
            if not seen_only:
                self._records.setdefault(name, IdentityRecord(name=name))
            if name not in self._records:
                known = ", ".join(sorted(self._records)) or "none yet"
                raise InputError(f"no identity {name!r} has called this aggregator (known: {known})")
            at = self.revoked.setdefault(name, self.clock())
            self._records[name].revoked_at = at
            atomic_write(self.path, json.dumps({"revoked": self.revoked}, indent=1).encode())
            return at

    def records(self) -> tuple[IdentityRecord, ...]:
        """Copies of every record, by name."""
        with self._lock:
            return tuple(IdentityRecord(name=r.name, role=r.role, fingerprint=r.fingerprint, joined=set(r.joined),
                                        accepted=r.accepted, refused=Counter(r.refused), audited=r.audited,
                                        failed=r.failed, revoked_at=r.revoked_at, applied=r.applied,
                                        dropped=Counter(r.dropped))
                         for _, r in sorted(self._records.items()))

    def _read(self) -> dict[str, float]:
        if not self.path.exists():
            return {}
        try:
            revoked = json.loads(self.path.read_bytes())["revoked"]
            ok = isinstance(revoked, dict) and all(isinstance(k, str) and isinstance(v, (int, float))
                                                   for k, v in revoked.items())
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{self.path} cannot be read as the swarm's revocations: {exc}") from exc
        if not ok:
            raise CheckpointError(f"{self.path} cannot be read as the swarm's revocations: unexpected value types")
        return {k: float(v) for k, v in revoked.items()}
