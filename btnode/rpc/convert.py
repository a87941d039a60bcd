"""Protobuf ⇄ domain objects. Every field coming from a peer is checked here before it becomes a
domain value; a bad enum, a negative dimension or a missing header is MalformedInput. Each wire enum
is matched to its domain enum by name (`WireEnum`, rpc/wire.py, which holds what a light client of a
chain needs), and the import fails if the two drift apart; settings travel as typed messages that
mirror their frozen dataclasses field for field."""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

from btnode import __version__
from btnode.aggregate.trust.identities import Role
from btnode.aggregate.service import SwarmStatus
from btnode.codec.bundles import BundleHeader
from btnode.codec.codecs import Codec
from btnode.codec.frames import DTYPE, ChunkData, FrameHeader
from btnode.errors import MalformedInput
from btnode.model.config import ModelConfig
from btnode.protocol import (MAX_NAME, Attestation, ClosedBy, Duties, EvidenceChild, Judgement, JoinInfo, ManifestEntry,
                             Outcome, PushHeader, RoundReceipt, StateWanted, TraceWanted, VerifyTask, VersionInfo,
                             WorkClaim)
from btnode.train.config import Precision, TrainConfig
from btnode.train.terms import H, TrainingTerms
from btnode.v2 import settings_pb2 as settings_pb
from btnode.v2 import swarm_pb2 as pb
from btnode.rpc.wire import (_MODEL_FIELDS, READOUTS, UNIT_KINDS, WireEnum, model_dict_from_pb,  # noqa: F401 - re-exported
                             model_from_pb, model_to_pb, readout_from_pb)

CODECS = WireEnum(pb.Codec, Codec)
OUTCOMES = WireEnum(pb.PushOutcome, Outcome)
CLOSED_BY = WireEnum(pb.ClosedBy, ClosedBy, unspecified=ClosedBy.NONE)
ROLES = WireEnum(pb.IdentityRole, Role)
PRECISIONS = WireEnum(settings_pb.Precision, Precision)
WIRE_ENUMS = (CODECS, OUTCOMES, CLOSED_BY, ROLES, UNIT_KINDS, PRECISIONS, READOUTS)
# The codec registry is keyed by the wire number too: refuse to start if the numbers ever differ.
if any(CODECS.to_pb(c) != c.value for c in Codec):
    raise ImportError(f"btnode.v2.Codec's numbers and btnode.codec.Codec {[(c.name, c.value) for c in Codec]} disagree")

# Settings messages mirror their dataclasses field for field (TrainingSettings adds H).
_TRAIN_FIELDS = tuple(f.name for f in dataclasses.fields(TrainConfig))
for _message, _fields in ((settings_pb.ModelSettings, _MODEL_FIELDS), (settings_pb.TrainingSettings, _TRAIN_FIELDS + (H,))):
    if set(_message.DESCRIPTOR.fields_by_name) != set(_fields):
        raise ImportError(f"{_message.DESCRIPTOR.full_name} and its dataclass disagree: "
                          f"{sorted(set(_message.DESCRIPTOR.fields_by_name) ^ set(_fields))}")

MAX_DIMS = 8
MAX_RECIPE = 1024  # characters of a claim's recipe (Recipe.to_json(): a few short fields)
_CLAIM_HASHES = ("base_sha256", "optimizer_start", "optimizer_end", "residual_start", "residual_end")


def model_text_to_pb(config_json: str) -> settings_pb.ModelSettings | None:
    """A worker's swarm-wide settings (ModelConfig.to_dict's JSON) as the wire carries them; None when the
    text is not such settings (the aggregator then says that it could not read them)."""
    try:
        return model_to_pb(ModelConfig.from_dict(json.loads(config_json)))
    except (ValueError, TypeError, AttributeError):  # ConfigError is a ValueError too
        return None


def model_text_from_pb(m: settings_pb.ModelSettings | None) -> str:
    """The settings a joining worker stated, as the JSON text the aggregator reads ("" for none)."""
    return json.dumps(model_dict_from_pb(m)) if m is not None else ""


def training_to_pb(terms: TrainingTerms) -> settings_pb.TrainingSettings:
    fields = {n: getattr(terms.train, n) for n in _TRAIN_FIELDS}
    if fields["k1_share"] is None:
        del fields["k1_share"]  # absent: every K equally often
    return settings_pb.TrainingSettings(**{**fields, "precision": PRECISIONS.to_pb(terms.train.precision),
                                           H: terms.steps_per_round})


def training_json_from_pb(m: settings_pb.TrainingSettings) -> str:
    """The JSON text TrainingTerms.to_json makes of these settings, for the aggregator to judge
    (TrainingTerms.from_json) and for the join signature, which covers that text: built field by
    field, not through TrainConfig, so that settings it refuses reach the judge (and its count)."""
    fields: dict[str, Any] = {n: getattr(m, n) for n in _TRAIN_FIELDS}
    fields["k1_share"] = m.k1_share if m.HasField("k1_share") else None
    precision = PRECISIONS.member(m.precision)
    fields["precision"] = precision.value if precision is not None else f"precision#{m.precision}"
    return json.dumps({**fields, H: m.steps_per_round}, sort_keys=True)


def codec_from_pb(value: int) -> Codec:
    codec = CODECS.from_pb(value, "codec")
    if codec is None:
        raise MalformedInput("codec", f"unknown codec value {value}")
    return codec


def header_to_pb(h: FrameHeader) -> pb.FrameHeader:
    return pb.FrameHeader(name=h.name, dtype=pb.DTYPE_FLOAT32, shape=list(h.shape), codec=CODECS.to_pb(h.codec),
                          raw_bytes=h.raw_bytes, payload_bytes=h.payload_bytes, sha256=h.sha256)


def header_from_pb(m: pb.FrameHeader) -> FrameHeader:
    if len(m.name) > MAX_NAME or len(m.shape) > MAX_DIMS or any(d < 0 for d in m.shape):
        raise MalformedInput("header", f"malformed frame header for {m.name[:64]!r}")
    dtype = DTYPE if m.dtype == pb.DTYPE_FLOAT32 else f"dtype#{m.dtype}"
    return FrameHeader(name=m.name, shape=tuple(int(d) for d in m.shape), codec=codec_from_pb(m.codec),
                       raw_bytes=int(m.raw_bytes), payload_bytes=int(m.payload_bytes), sha256=bytes(m.sha256),
                       dtype=dtype)


def bundle_to_pb(h: BundleHeader) -> pb.BundleHeader:
    return pb.BundleHeader(codec=CODECS.to_pb(h.codec), tensors=h.tensors, raw_bytes=h.raw_sizes, digest=h.digest)


def bundle_from_pb(m: pb.BundleHeader) -> BundleHeader:
    if len(m.raw_bytes) != (m.tensors if m.raw_bytes else 0):  # (the spec's count is checked by the assembler)
        raise MalformedInput("bundle", f"a bundle of {m.tensors} tensors states {len(m.raw_bytes)} sizes")
    return BundleHeader(codec=codec_from_pb(m.codec), tensors=int(m.tensors), raw_sizes=tuple(int(n) for n in m.raw_bytes),
                        digest=bytes(m.digest))


def chunk_to_pb(c: ChunkData) -> pb.Chunk:
    if c.header is None:
        return pb.Chunk(data=c.data)
    if isinstance(c.header, BundleHeader):
        return pb.Chunk(bundle=bundle_to_pb(c.header), data=c.data)
    return pb.Chunk(header=header_to_pb(c.header), data=c.data)


def chunk_from_pb(m: pb.Chunk) -> ChunkData:
    if m.HasField("bundle"):
        if m.HasField("header"):
            raise MalformedInput("header", "a chunk carries a frame header or a bundle header, not both")
        return ChunkData(header=bundle_from_pb(m.bundle), data=bytes(m.data))
    return ChunkData(header=header_from_pb(m.header) if m.HasField("header") else None, data=bytes(m.data))


def info_to_pb(i: VersionInfo) -> pb.VersionInfo:
    return pb.VersionInfo(block=i.block, version=i.version, base_version=i.base_version, sha256=bytes.fromhex(i.sha256),
                          delta_codec=CODECS.to_pb(i.delta_codec), accepted=i.accepted, late=i.late, stale=i.stale,
                          rejected=i.rejected, mean_loss=i.mean_loss, closed_by=CLOSED_BY.to_pb(i.closed_by),
                          included=i.included)


def info_from_pb(m: pb.VersionInfo) -> VersionInfo:
    if len(m.sha256) != 32:
        raise MalformedInput("checksum", "version announcement without a valid sha256")
    return VersionInfo(block=m.block, version=m.version, base_version=m.base_version, sha256=m.sha256.hex(),
                       delta_codec=codec_from_pb(m.delta_codec), accepted=m.accepted, late=m.late, stale=m.stale,
                       rejected=m.rejected, mean_loss=m.mean_loss,
                       closed_by=CLOSED_BY.from_pb(m.closed_by, "closed_by") or ClosedBy.NONE,
                       included=tuple(m.included))


def claim_to_pb(c: WorkClaim) -> pb.WorkClaim:
    return pb.WorkClaim(data_id=c.data_id, recipe=c.recipe, **{f: bytes.fromhex(getattr(c, f)) for f in _CLAIM_HASHES})


def claim_from_pb(m: pb.WorkClaim) -> WorkClaim:
    if any(len(getattr(m, f)) != 32 for f in _CLAIM_HASHES):
        raise MalformedInput("claim", "a work claim's state hashes are sha256 digests of 32 bytes")
    if len(m.data_id) > MAX_NAME or len(m.recipe) > MAX_RECIPE:
        raise MalformedInput("claim", f"a work claim's data id is at most {MAX_NAME} characters and its recipe at "
                                      f"most {MAX_RECIPE}")
    return WorkClaim(data_id=m.data_id, recipe=m.recipe, **{f: getattr(m, f).hex() for f in _CLAIM_HASHES})


MAX_CERT, MAX_SIGNATURE = 8192, 256  # a P-256 certificate in PEM is under 1 KB, its ECDSA signature 72 bytes
MAX_TOKEN = 64  # a root's commit token: an HMAC-SHA256 (32 bytes)


def push_header_to_pb(h: PushHeader) -> pb.PushHeader:
    return pb.PushHeader(worker_id=h.worker_id, block=h.block, base_version=h.base_version, samples=h.samples,
                         loss=h.loss, codec=CODECS.to_pb(h.codec), update_id=h.update_id, data_key=h.data_key, steps=h.steps,
                         claim=claim_to_pb(h.claim) if h.claim is not None else None,
                         manifest=[pb.ManifestEntry(worker_id=e.worker_id, update_id=e.update_id,
                                                    base_version=e.base_version, weight=e.weight,
                                                    sha256=bytes.fromhex(e.sha256), samples=e.samples, cert=e.cert,
                                                    signature=e.signature, claim_sha256=bytes.fromhex(e.claim_sha256),
                                                    token=e.token) for e in h.manifest],
                         cert=h.cert, signature=h.signature)


def proof_from_pb(cert: bytes, signature: bytes, what: str) -> tuple[bytes, bytes]:
    """A certificate and signature as sent (checked in full by rpc/certs.verify_signed): sizes only here."""
    if len(cert) > MAX_CERT or len(signature) > MAX_SIGNATURE:
        raise MalformedInput(what, f"a certificate is at most {MAX_CERT} bytes and a signature {MAX_SIGNATURE}")
    return bytes(cert), bytes(signature)


def manifest_from_pb(m: pb.PushHeader) -> tuple[ManifestEntry, ...]:
    out = []
    for e in m.manifest:
        if not e.worker_id or not e.update_id or len(e.worker_id) > MAX_NAME or len(e.update_id) > MAX_NAME:
            raise MalformedInput("manifest", "a manifest entry needs a worker id and an update id (≤ 256 characters)")
        if not (math.isfinite(e.weight) and e.weight > 0) or len(e.sha256) != 32:
            raise MalformedInput("manifest", f"manifest entry {e.update_id[:16]!r}: weight must be positive and "
                                             f"sha256 32 bytes")
        if not math.isfinite(e.samples) or e.samples < 0:
            raise MalformedInput("manifest", f"manifest entry {e.update_id[:16]!r}: samples must be finite and >= 0")
        if len(e.claim_sha256) not in (0, 32) or len(e.token) > MAX_TOKEN:
            raise MalformedInput("manifest", f"manifest entry {e.update_id[:16]!r}: a claim digest is 32 bytes and a "
                                             f"commit token at most {MAX_TOKEN}")
        cert, signature = proof_from_pb(e.cert, e.signature, "manifest")
        out.append(ManifestEntry(worker_id=e.worker_id, update_id=e.update_id, base_version=e.base_version,
                                 weight=e.weight, sha256=e.sha256.hex(), samples=e.samples, cert=cert,
                                 signature=signature, claim_sha256=e.claim_sha256.hex(), token=bytes(e.token)))
    return tuple(out)


def push_header_from_pb(m: pb.PushHeader) -> PushHeader:
    if not m.worker_id or not m.update_id or len(m.worker_id) > MAX_NAME or len(m.update_id) > MAX_NAME:
        raise MalformedInput("header", "push header needs a worker_id and an update_id (≤ 256 characters)")
    if not (math.isfinite(m.samples) and m.samples > 0):
        raise MalformedInput("samples", f"update weight must be a positive number, got {m.samples}")
    if len(m.data_key) > MAX_NAME:
        raise MalformedInput("header", f"push header's data key is over {MAX_NAME} characters")
    return PushHeader(worker_id=m.worker_id, block=m.block, base_version=m.base_version, samples=m.samples,
                      loss=m.loss, codec=codec_from_pb(m.codec), update_id=m.update_id, data_key=m.data_key,
                      steps=tuple(m.steps), claim=claim_from_pb(m.claim) if m.HasField("claim") else None,
                      manifest=manifest_from_pb(m), **dict(zip(("cert", "signature"),
                                                              proof_from_pb(m.cert, m.signature, "header"))))


def evidence_child_to_pb(c: EvidenceChild) -> pb.EvidenceChild:
    return pb.EvidenceChild(update_id=c.update_id, weight=c.weight, scale=c.scale, entries=c.entries)


def evidence_child_from_pb(m: pb.EvidenceChild) -> EvidenceChild:
    if not m.update_id or len(m.update_id) > MAX_NAME:
        raise MalformedInput("evidence", "an evidence child needs an update id (≤ 256 characters)")
    return EvidenceChild(update_id=m.update_id, weight=m.weight, scale=m.scale, entries=m.entries)


def judgement_to_pb(j: Judgement) -> pb.PushReply:
    return pb.PushReply(outcome=OUTCOMES.to_pb(j.outcome), reason=j.reason, round_version=j.round_version, audit=j.audit,
                        closes_in_s=j.closes_in_s)


def judgement_from_pb(m: pb.PushReply) -> Judgement:
    outcome = OUTCOMES.from_pb(m.outcome, "outcome")
    if outcome is None:
        raise MalformedInput("outcome", f"unknown push outcome {m.outcome}")
    closes_in = m.closes_in_s if math.isfinite(m.closes_in_s) and m.closes_in_s > 0 else 0.0
    return Judgement(outcome=outcome, reason=m.reason, round_version=m.round_version,
                     audit=m.audit, closes_in_s=closes_in)


def round_receipt_to_pb(r: RoundReceipt) -> pb.RoundReceipt:
    return pb.RoundReceipt(update_id=r.update_id, outcome=OUTCOMES.to_pb(r.outcome), version=r.version, reason=r.reason)


def round_receipt_from_pb(m: pb.RoundReceipt) -> RoundReceipt:
    """A receipt a peer sent: APPLIED or DROPPED, for an update id; anything else is MalformedInput."""
    outcome = OUTCOMES.from_pb(m.outcome, "receipt")
    if outcome not in (Outcome.APPLIED, Outcome.DROPPED):
        raise MalformedInput("receipt", f"a receipt says applied or dropped, not {outcome.value if outcome else 'nothing'}")
    if not m.update_id or len(m.update_id) > MAX_NAME or len(m.reason) > MAX_NAME:
        raise MalformedInput("receipt", "a receipt names an update id, and a reason, of at most 256 characters")
    return RoundReceipt(update_id=m.update_id, outcome=outcome, version=m.version, reason=m.reason)


def join_to_pb(j: JoinInfo) -> pb.JoinReply:
    return pb.JoinReply(current=info_to_pb(j.current), deadline_s=j.deadline_s, codecs=[CODECS.to_pb(c) for c in j.codecs],
                        max_staleness=j.max_staleness, data_key=j.data_key, audits=j.audits,
                        relay_audits=j.relay_audits, bundles=j.bundles)


def join_from_pb(m: pb.JoinReply) -> JoinInfo:
    return JoinInfo(current=info_from_pb(m.current), deadline_s=m.deadline_s,
                    codecs=tuple(codec_from_pb(c) for c in m.codecs), max_staleness=m.max_staleness,
                    data_key=m.data_key, audits=m.audits, relay_audits=m.relay_audits, bundles=m.bundles)


def status_to_pb(s: SwarmStatus, server_time_unix: float) -> pb.StatusReply:
    """The Status reply: per-block counts become "updates" counters labelled by block, outcome
    and reason; swarm-wide events follow, labelled by reason. `node_version`: this build's."""
    reply = pb.StatusReply(fingerprint=s.fingerprint, config=model_to_pb(s.config), server_time_unix=server_time_unix,
                           data_id=s.data_id or "", node_version=__version__)
    for b in s.blocks:
        bs = reply.blocks.add(block=b.block, current=info_to_pb(b.current), replicas=b.replicas,
                              round_age_s=b.round_age_s, accepted_in_round=b.accepted_in_round, data_keys=b.data_keys)
        for r in b.recent:
            bs.recent.add(version=info_to_pb(r.info), closed_at_unix=r.closed_at)
        for r in b.relays:
            bs.relays.add(name=r.name, children=r.children, last_version=r.last_version, last_weight=r.last_weight,
                          pushes=r.pushes, refused=r.refused)
        for (outcome, reason), n in b.updates.items():
            reply.counters.add(name="updates", labels={"block": str(b.block), "outcome": outcome, "reason": reason},
                               value=n)
    for (name, reason), n in s.events.items():
        reply.counters.add(name=name, labels={"reason": reason}, value=n)
    for r in s.identities:
        reply.identities.add(name=r.name, role=ROLES.to_pb(Role(r.role)) if r.role else 0, fingerprint=r.fingerprint, joined=sorted(r.joined),
                             accepted=r.accepted, refused=dict(r.refused), audited=r.audited, failed=r.failed,
                             revoked_at_unix=r.revoked_at or 0.0, applied=r.applied, dropped=dict(r.dropped),
                             verified=r.verified, verify_seconds=r.verify_s)
    return reply


# -- delegated verification (aggregate/trust/delegate.py, swarm/verify.py) ------------------------------------
MAX_KEEP = 1 << 20  # a task's keep: a sparse codec's values per 4,096-value chunk (4,096 for a dense one)
MAX_TRACE = 1 << 16  # digests in a trace: one per claimed step


def name_from_pb(text: str, what: str) -> str:
    """A task id or worker id a peer sent: non-empty, at most MAX_NAME characters."""
    if not text or len(text) > MAX_NAME:
        raise MalformedInput(what, f"a {what} is 1 to {MAX_NAME} characters")
    return text


def _digest_to_pb(hexdigest: str, what: str) -> bytes:
    try:
        raw = bytes.fromhex(hexdigest)
    except ValueError:
        raw = b""
    if len(raw) != 32:
        raise MalformedInput(what, f"a {what} is a sha256 digest (64 hex characters), not {hexdigest[:80]!r}")
    return raw


def _digest_from_pb(raw: bytes, what: str) -> str:
    if len(raw) != 32:
        raise MalformedInput(what, f"a {what} is a sha256 digest of 32 bytes, not {len(raw)}")
    return bytes(raw).hex()


def task_to_pb(t: VerifyTask) -> pb.VerifyTask:
    return pb.VerifyTask(task_id=t.task_id, header=push_header_to_pb(t.header),
                         terms=training_to_pb(TrainingTerms.from_json(t.terms_json)), keep=t.keep)


def task_from_pb(m: pb.VerifyTask) -> VerifyTask:
    """A task as the aggregator sent it: its header checked as a push's, its terms as a join's, and a claim in it."""
    if not m.HasField("header") or not m.HasField("terms"):
        raise MalformedInput("task", "a verification task carries the author's push header and training terms")
    header = push_header_from_pb(m.header)
    if header.claim is None or not header.steps:
        raise MalformedInput("task", f"verification task {m.task_id[:16]!r} has no work claim or no steps")
    if not 0 < m.keep <= MAX_KEEP:
        raise MalformedInput("task", f"verification task {m.task_id[:16]!r}: keep {m.keep} is not in [1, {MAX_KEEP}]")
    terms = TrainingTerms.from_json(training_json_from_pb(m.terms))  # MalformedInput("training") if refused
    return VerifyTask(task_id=name_from_pb(m.task_id, "task_id"), header=header, terms_json=terms.to_json(),
                      keep=int(m.keep))


def duties_to_pb(d: Duties) -> pb.DutiesReply:
    return pb.DutiesReply(tasks=[task_to_pb(t) for t in d.tasks], traces=[task_to_pb(t.task) for t in d.traces],
                          states=[pb.StateWanted(task=task_to_pb(s.task), k=s.k) for s in d.states],
                          children=[pb.ChildDuties(worker_id=w, duties=duties_to_pb(c)) for w, c in d.children.items()])


def duties_from_pb(m: pb.DutiesReply, *, nested: bool = False) -> Duties:
    states = []
    for s in m.states:
        if not s.HasField("task") or s.k < 1:
            raise MalformedInput("task", "a state wanted names its task and a step count of at least 1")
        states.append(StateWanted(task_from_pb(s.task), int(s.k)))
    if nested and m.children:
        raise MalformedInput("children", "a child's duties carry no children of their own")
    children: dict[str, Duties] = {}
    for c in m.children:
        worker = name_from_pb(c.worker_id, "worker_id")
        if worker in children:
            raise MalformedInput("children", f"duties name child {worker!r} twice")
        children[worker] = duties_from_pb(c.duties, nested=True)
    return Duties(tasks=[task_from_pb(t) for t in m.tasks], traces=[TraceWanted(task_from_pb(t)) for t in m.traces],
                  states=states, children=children)


def attestation_to_pb(block: int, a: Attestation) -> pb.AttestRequest:
    return pb.AttestRequest(block=block, task_id=a.task_id, verifier=a.verifier,
                            digest=_digest_to_pb(a.digest, "digest"), seconds=a.seconds, cert=a.cert,
                            signature=a.signature)


def attestation_from_pb(m: pb.AttestRequest) -> Attestation:
    if not (math.isfinite(m.seconds) and m.seconds >= 0):
        raise MalformedInput("seconds", f"an attestation's seconds are finite and at least 0, not {m.seconds}")
    return Attestation(task_id=name_from_pb(m.task_id, "task_id"), verifier=name_from_pb(m.verifier, "verifier"),
                       digest=_digest_from_pb(m.digest, "digest"), seconds=m.seconds,
                       **dict(zip(("cert", "signature"), proof_from_pb(m.cert, m.signature, "attest"))))


def trace_to_pb(trace: tuple[str, ...]) -> list[bytes]:
    return [_digest_to_pb(d, "trace") for d in trace]


def trace_from_pb(trace) -> tuple[str, ...]:  # type: ignore[no-untyped-def] - a repeated bytes field
    if len(trace) > MAX_TRACE:
        raise MalformedInput("trace", f"a trace of {len(trace)} digests, over {MAX_TRACE}")
    return tuple(_digest_from_pb(d, "trace") for d in trace)
