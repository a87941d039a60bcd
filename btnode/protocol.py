"""The swarm's shared vocabulary, free of gRPC: versions, push headers, outcomes, and the one
`Upstream` a worker or a relay talks to its aggregator through. rpc/ converts these to and from
protobuf messages; an in-process link (tests, the simulator) can implement Upstream without any network."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from enum import Enum, StrEnum
from typing import Protocol

import torch

from btnode.codec.codecs import Codec
from btnode.codec.frames import ChunkData, Frame
from btnode.meter import Meter  # noqa: F401 - re-exported: the swarm's vocabulary
from btnode.settings import flag

MAX_NAME = 256  # characters of a worker id, update id, tensor name or data id a peer may send
ABORTED = "aborted"  # reason for a push whose sender vanished mid-stream: it may still re-push
# An update that did not arrive whole says nothing about whether its replica is done with the round
# (a dropped connection can look like either reason), so these do not count as the replica reporting.
INCOMPLETE = {ABORTED, "truncated"}


class Outcome(Enum):
    """A push's answer on arrival (PENDING, PROBATION, LATE, STALE, REJECTED), and the final word on
    one taken into a round, its `RoundReceipt` (APPLIED, DROPPED): the round's close may still drop an
    update it took (the robust screen, a revocation, a failed audit), so no answer on arrival says
    applied. ACCEPTED is an older aggregator's answer (taken into its round, no receipt to follow)."""

    ACCEPTED = "accepted"
    LATE = "late"
    STALE = "stale"
    REJECTED = "rejected"
    PROBATION = "probation"  # valid, held out of the round: its sender is new and is audited first
    PENDING = "pending"  # in the open round, not applied yet: its receipt comes with the next version
    APPLIED = "applied"  # a receipt: in the version its round made
    DROPPED = "dropped"  # a receipt: left out of that version, with the reason

    @property
    def in_round(self) -> bool:
        """The update may still be applied: taken into a round (or held there for its audit)."""
        return self in (Outcome.PENDING, Outcome.ACCEPTED, Outcome.PROBATION)


class ClosedBy(StrEnum):
    """What closed the round that made a version. A str enum, so that the reason reads, logs, labels
    metrics and is stored as the plain string it always was ("deadline" == ClosedBy.DEADLINE)."""

    NONE = ""  # no round made it: the seed version
    DEADLINE = "deadline"  # the round's deadline, with enough updates in
    ALL_REPORTED = "all_reported"  # every registered replica reported
    DRAIN = "drain"  # the node stopped cleanly and published its open round
    AMENDED = "amended"  # a relay's round closed early to amend a combined push


@dataclass(frozen=True)
class VersionInfo:
    block: int
    version: int
    base_version: int  # the published delta turns base_version into version (0 → 0 for the seed)
    sha256: str  # store.files.state_sha256 of θ^version
    delta_codec: Codec = Codec.FP32
    accepted: int = 0
    late: int = 0
    stale: int = 0
    rejected: int = 0
    mean_loss: float = float("nan")
    closed_by: ClosedBy = ClosedBy.NONE  # a close reason's string is taken too (ValueError for an unknown one)
    included: tuple[str, ...] = ()  # update ids that went in (direct pushes' own, relays' manifest entries)

    def __post_init__(self) -> None:
        object.__setattr__(self, "closed_by", ClosedBy(self.closed_by))


@dataclass(frozen=True)
class RoundSize:
    """H, declared once: a worker trains H steps per update, and the aggregator judges the steps an
    update claims by it (aggregate/trust/claims.py), so both take the one `--steps-per-round`."""

    steps_per_round: int = flag("--steps-per-round", "H: local steps per update.", default=50)


EMPTY_STATE = hashlib.sha256().hexdigest()  # state_sha256 of no tensors: a fresh optimizer, or no residual
OPTIMIZER_PREFIX, RESIDUAL_PREFIX = "opt.", "ef."  # the names of a start state's tensors (SubmitState)


@dataclass(frozen=True)
class WorkClaim:
    """What a pushed delta depends on, committed with it (docs/security.md, "Work claims and replay
    audits"). With the header's base version, steps and data key, it names everything a replay needs:
    the base θ by hash, the data by id, how the worker trains (`recipe`: its arithmetic, which decides
    whether a replay must match bit for bit), and the worker's inner state by hash at the start and
    end of the round. Each round's start is the previous round's end (a chain the aggregator checks),
    so no state change between rounds goes unaccounted."""

    base_sha256: str  # θ^base_version's state_sha256
    data_id: str  # the data the windows were drawn from (btnode.data.identity)
    recipe: str  # Recipe.to_json() of the worker
    optimizer_start: str  # state_sha256 of the inner AdamW state before the first step (EMPTY_STATE: fresh)
    optimizer_end: str  # ... after the last step
    residual_start: str  # state_sha256 of the error-feedback residual added into this delta (EMPTY_STATE: none)
    residual_end: str  # ... and of the one it leaves for the next update


@dataclass(frozen=True)
class ManifestEntry:
    """One child update inside a relay's combined push (docs/swarm.md, "Relays")."""

    worker_id: str
    update_id: str
    base_version: int
    weight: float  # the weight the relay counted it with
    sha256: str  # hex sha256 over the child's raw codec bytes, frames in name order
    samples: float = 0.0  # the child's own weight claim (0: not stated), which `signature` covers
    cert: bytes = b""  # under mutual TLS: the child's certificate (PEM) and its signature over push_statement
    signature: bytes = b""
    claim_sha256: str = ""  # claim_digest of the child's work claim ("": none), which `signature` covers
    token: bytes = b""  # under a root that replays audits: its commit token for this update (Drawn.token)


@dataclass(frozen=True)
class Drawn:
    """A root's answer to a relay committing a child update (SwarmAggregator.draw): `drawn`, the relay
    pushes the update as it came, for a replay audit; else `token`, which its manifest entry carries."""

    drawn: bool
    token: bytes = b""


@dataclass(frozen=True)
class VerifyTask:
    """A drawn update another worker is asked to replay (delegated verification, aggregate/trust/delegate.py):
    the author's push header (its work claim in it), the author's training terms (train.terms JSON) and
    the keep its frames state. θ^base and the author's start state come with `Upstream.verify_inputs`."""

    task_id: str
    header: PushHeader
    terms_json: str
    keep: int


@dataclass(frozen=True)
class Attestation:
    """A verifier's result for a task: the train.replay `result_digest` of its replay, and what the replay cost."""

    task_id: str
    verifier: str  # its identity (under mutual TLS, the caller's own name)
    digest: str
    seconds: float
    cert: bytes = b""  # the verifier's certificate and signature over attest_statement: what a relay passes on
    signature: bytes = b""


@dataclass(frozen=True)
class TraceWanted:
    """A party to a disputed verification is asked for the trace of the round (a state digest per step)."""

    task: VerifyTask


@dataclass(frozen=True)
class StateWanted:
    """A party to a dispute is asked for the whole state (θ and optimizer) after `k` steps of the round."""

    task: VerifyTask
    k: int


@dataclass
class Duties:
    """The verification work handed to one worker since it last asked, each item once."""

    tasks: list[VerifyTask] = field(default_factory=list)
    traces: list[TraceWanted] = field(default_factory=list)
    states: list[StateWanted] = field(default_factory=list)
    children: dict[str, Duties] = field(default_factory=dict)  # to a relay: its children's, by worker id

    def __bool__(self) -> bool:
        return bool(self.tasks or self.traces or self.states or self.children)

    def __len__(self) -> int:
        """Items handed (a relay's children's included)."""
        return len(self.tasks) + len(self.traces) + len(self.states) + sum(len(d) for d in self.children.values())

    def add(self, more: Duties) -> None:
        """Keep `more` too (a relay's mailbox for one child: aggregate/relay/duties.py)."""
        self.tasks.extend(more.tasks)
        self.traces.extend(more.traces)
        self.states.extend(more.states)


@dataclass(frozen=True)
class EvidenceChild:
    """One update in a relay's evidence for a combined push (docs/swarm.md, "Relays"); the frames of
    that update, as the relay received them, follow it in the stream."""

    update_id: str  # a manifest entry's, or a child relay's combined push's
    weight: float  # the weight the relay summed it with
    scale: float = 1.0  # the --clip factor applied before summing
    entries: int = 1  # manifest entries it stands for (a child relay's: its children)


@dataclass(frozen=True)
class PushHeader:
    worker_id: str
    block: int
    base_version: int
    samples: float  # weight: windows trained since the base version
    loss: float  # mean training CE over those steps
    codec: Codec
    update_id: str
    data_key: str = ""  # the key its windows were drawn with (empty: not stated, an older worker)
    steps: tuple[int, ...] = ()  # the step of each batch trained into it: windows = batch(seed, data_key, step, …)
    claim: WorkClaim | None = None  # what the delta depends on (None: an older worker)
    manifest: tuple[ManifestEntry, ...] = ()  # a relay's combined push: the child updates in it
    cert: bytes = b""  # under mutual TLS, a worker's push: its certificate (PEM) and signature over push_statement
    signature: bytes = b""


@dataclass(frozen=True)
class Judgement:
    outcome: Outcome
    reason: str
    round_version: int
    audit: bool = False  # the update was drawn for a replay audit: send its start state (Upstream.submit_state)
    closes_in_s: float = 0.0  # to a relay's combined push in an open round: seconds to its deadline (0: not said)


@dataclass(frozen=True)
class RoundReceipt:
    """The final word on an update answered PENDING or PROBATION, once its round closed (or it was taken
    out of it): APPLIED in `version`, or DROPPED from it with `reason` (norm_at_close, direction_at_close,
    revoked, audit_<why>, audited_after_close, ...). A worker gets its own with the next version."""

    update_id: str
    outcome: Outcome  # APPLIED or DROPPED
    version: int  # the version its round made: the update is in it, or left out of it
    reason: str = ""  # why it was dropped

    def __post_init__(self) -> None:
        assert self.outcome in (Outcome.APPLIED, Outcome.DROPPED), self.outcome


@dataclass(frozen=True)
class JoinInfo:
    current: VersionInfo
    deadline_s: float
    codecs: tuple[Codec, ...]
    max_staleness: int
    data_key: str = ""  # which windows the worker trains (see btnode/aggregate/trust/datakeys.py); empty: an older aggregator
    audits: bool = False  # updates may be replayed: train nothing while waiting, and keep each round's start state
    relay_audits: bool = False  # to a relay: its combined pushes may be audited (aggregate/trust/evidence.py)
    bundles: bool = True  # the aggregator reads a push's bundle (codec/bundles.py); an older one does not: frames


@dataclass
class Transfer:
    """Bytes a call moved: codec representation before zstd, and payload after."""

    raw: int = 0
    wire: int = 0
    seconds: float = 0.0


@dataclass
class Pulled:
    info: VersionInfo
    tensors: dict[str, torch.Tensor]
    transfer: Transfer = field(default_factory=Transfer)
    raw: dict[str, bytes] = field(default_factory=dict)  # each frame's codec bytes (a relay re-serves them as they came)


class Upstream(Protocol):
    """What a worker or a relay asks of the aggregator above it (rpc.client.SwarmClient, the failover
    link over several of them, or sim.link.LocalLink in process). A worker uses the joins, pulls,
    pushes and version streams; a relay also passes its children's signed joins on (`proof`), commits
    its children's updates (`draw`) and sends the evidence of its combined pushes."""

    def join(self, worker_id: str, block: int, fingerprint: str, config_json: str, data_id: str = "", *,
             training_json: str = "", relay: bool = False, proof: tuple[bytes, bytes] | None = None) -> JoinInfo:
        """`training_json`: the worker's TrainingTerms (btnode.train.terms), which the aggregator judges
        its claims by; empty: not stated (an older worker). `relay`: a relay joins to push combined
        updates; `proof`: a child's certificate and signature over its join, which a relay passes on."""

    def leave(self, worker_id: str, block: int) -> None: ...

    def pull(self, block: int, worker_id: str, spec: Mapping[str, tuple[int, ...]]) -> Pulled: ...

    def fetch_delta(self, block: int, version: int, spec: Mapping[str, tuple[int, ...]]) -> Pulled: ...

    def push(self, header: PushHeader, frames: Iterable[Frame]) -> Judgement: ...

    def submit_state(self, header: PushHeader, frames: Iterable[Frame | ChunkData]) -> None:
        """Send the inner state an update drawn for audit started from (its optimizer state and residual,
        whose hashes its claim commits to); PeerInputError when the aggregator refuses it."""

    def draw(self, header: PushHeader, digest: str, relay: str = "", *, refused: bool = False) -> Drawn:
        """A relay commits a child's update (its header and frames digest) before it counts it; `relay`:
        its name, which a root without mutual TLS hands the child's verification duties to; `refused`:
        one the relay answered LATE or STALE without counting it (its claim moves the chain on only)."""

    def watch(self, block: int, worker_id: str) -> Iterator[VersionInfo]: ...

    def receipt(self, block: int, worker_id: str, update_id: str) -> RoundReceipt | None:
        """The receipt of `worker_id`'s update `update_id` (RoundReceipt), once its round closed: from the watch
        stream that delivered the version, else asked for; None while it is pending, or unknown here."""

    def states_wanted(self, block: int, worker_id: str) -> tuple[str, ...]:
        """Update ids of `worker_id`'s whose start states an audit asks for after their push was answered
        (dropped at close, or in a round a failed audit found attacked): from the watch stream's versions,
        else asked for with a RoundReceipt call. The worker sends each with `submit_state`."""

    def duties_waiting(self, block: int, worker_id: str) -> bool:
        """Whether duties wait for `worker_id`, as its version stream said (no call): it asks for them then."""

    def duties(self, block: int, worker_id: str) -> Duties:
        """The verification work (delegated replays, and traces or states for disputes) handed to
        `worker_id` since it last asked (aggregate/trust/delegate.py); asked by a relay under its own
        name, its children's (`Duties.children`)."""

    def verify_inputs(self, block: int, task_id: str, worker_id: str) -> tuple[Mapping[str, torch.Tensor], dict[str, torch.Tensor]]:
        """(θ^base, the author's start state) of a verification task `worker_id` has a part in."""

    def attest(self, block: int, attestation: Attestation) -> None:
        """A verifier's result for its task; PeerInputError when the task is not its own, or closed."""

    def submit_trace(self, block: int, task_id: str, worker_id: str, trace: tuple[str, ...], *,
                     proof: tuple[bytes, bytes] | None = None) -> None:
        """The trace a dispute asked `worker_id` for; `proof`: its certificate and signature over
        trace_statement, which a relay passes on (a worker's own link signs it)."""

    def submit_dispute_state(self, block: int, task_id: str, worker_id: str, k: int,
                             state: Mapping[str, torch.Tensor] | Iterable[ChunkData]) -> None:
        """The whole state after `k` steps that a dispute asked `worker_id` for (a relay passes a
        child's on as the chunks it came in)."""

    def cancel_watches(self, worker_id: str) -> None:
        """End the watch streams this link holds for `worker_id`, so that the thread reading them returns."""

    def close(self) -> None: ...


def format_steps(steps: Iterable[int]) -> str:
    """Steps as runs, for logs: (4, 5, 6, 9) → "4-6,9"."""
    runs: list[list[int]] = []
    for s in steps:
        if runs and s == runs[-1][1] + 1:
            runs[-1][1] = s
        else:
            runs.append([s, s])
    return ",".join(f"{a}-{b}" if b > a else str(a) for a, b in runs) or "none"


def join_statement(worker_id: str, block: int, fingerprint: str, data_id: str, training_json: str) -> bytes:
    """What a worker signs when it joins under mutual TLS (docs/security.md, "Relays"): a relay can
    pass the join on, and the root checks that the certificate's holder asked for exactly this."""
    training = hashlib.sha256(training_json.encode()).hexdigest()
    return b"btnode-join\0" + json.dumps([worker_id, block, fingerprint, data_id, training]).encode()


def claim_digest(claim: WorkClaim | None) -> str:
    """sha256 (hex) of a work claim, "" for none: what a push receipt signs of it, so that a relay
    passing a child's update on cannot change the claim a root audits it by."""
    if claim is None:
        return ""
    return hashlib.sha256(json.dumps([getattr(claim, f) for f in WorkClaim.__dataclass_fields__]).encode()).hexdigest()


def push_statement(worker_id: str, block: int, base_version: int, update_id: str, samples: float,
                   digest: str, claim_sha256: str = "") -> bytes:
    """What a worker signs when it pushes under mutual TLS: its push receipt. `digest`: the frames'
    digest (aggregate/evidence.frames_digest), which a relay's manifest entry names; `claim_sha256`:
    its work claim's claim_digest."""
    return b"btnode-push\0" + json.dumps([worker_id, block, base_version, update_id, float(samples).hex(),
                                           digest, claim_sha256]).encode()


def attest_statement(block: int, a: Attestation) -> bytes:
    """What a verifier signs with its attestation (docs/verification.md, "Through relays"): a relay
    passing it on can neither forge one nor change its digest or the work it claims."""
    return b"btnode-attest\0" + json.dumps([a.verifier, block, a.task_id, a.digest, float(a.seconds).hex()]).encode()


def trace_statement(block: int, task_id: str, worker_id: str, trace: tuple[str, ...]) -> bytes:
    """What a party to a dispute signs with its trace: a relay cannot make an honest party lose a bisection."""
    return b"btnode-trace\0" + json.dumps([worker_id, block, task_id, list(trace)]).encode()


def receipt_statement(header: PushHeader, digest: str) -> bytes:
    """The push receipt of a worker's push `header` whose frames have `digest` (push_statement)."""
    return push_statement(header.worker_id, header.block, header.base_version, header.update_id, header.samples,
                          digest, claim_digest(header.claim))
