"""Fuzzing of what peers send (issue #7): frame decoding, and every RPC handler of the aggregator
and of a stage, with random and mutated messages. Shared by tests/ (a few hundred cases, driven
by hypothesis) and bench/fuzz.py (tens of thousands). Every case is a seed: `Case(seed)` rebuilds
the same input, so a failure is reproduced from one number.

The oracle:
- frames (of every codec, the sparse ones at several densities; some mutated below zstd and sha256,
  so that they reach the codec's decoder): FrameAssembler either returns tensors that match the spec
  exactly or raises a PeerInputError; any other exception is a crash;
- RPCs: every call ends OK or with a status code a refusal may have (INVALID_ARGUMENT,
  RESOURCE_EXHAUSTED, NOT_FOUND, FAILED_PRECONDITION, OUT_OF_RANGE, DEADLINE_EXCEEDED for streams
  we stop waiting on); INTERNAL or UNKNOWN means a handler raised something unplanned: a crash.
  Afterwards the node still answers, and no block moved past version 0 unless valid updates were
  accepted (`Target.model_changed`).
SubmitState goes to a second aggregator, one with audits on and an audit always waiting for the start
state of update `AUDITED` (so that state streams reach their decoding; audits on the first would refuse
the fuzzed pushes for their missing claims before their frames are read).
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import grpc
import torch

from btnode.aggregate.sums.accumulate import Accumulator
from btnode.aggregate.trust.audit import AuditConfig, AuditJob
from btnode.train.replay import split_state
from btnode.aggregate.round.config import AggregatorConfig
from btnode.aggregate.trust.evidence import frames_digest
from btnode.aggregate.round.rounds import RoundConfig
from btnode.aggregate.service import SwarmAggregator
from btnode.codec.codecs import Codec, encode
from btnode.codec.bundles import BundleHeader
from btnode.codec.frames import (ChunkData, FrameAssembler, FrameHeader, bundle, encode_frames, frame_from_raw,
                                 iter_chunks)
from btnode.errors import PeerInputError
from btnode.model.config import ModelConfig
from btnode.protocol import EMPTY_STATE, OPTIMIZER_PREFIX, RESIDUAL_PREFIX, ManifestEntry, PushHeader, RoundSize, WorkClaim
from btnode.rpc import convert
from btnode.rpc.server import CHANNEL_OPTIONS, serve
from btnode.rpc.stages import serve_stage
from btnode.serve.stages import LocalBlockStage
from btnode.store.files import state_sha256
from btnode.store.models import init_block
from btnode.train.config import TrainConfig
from btnode.train.terms import TrainingTerms
from btnode.train.trainers import optimizer_spec
from btnode.v2 import serve_pb2, swarm_pb2

CFG = ModelConfig(d_model=16, n_heads=2, n_layers=1, n_blocks=2, context=16, segments=(1, 4))
REFUSALS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.NOT_FOUND,
            grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.DEADLINE_EXCEEDED}
AUDITED, AUDITEE = "audited", "s"  # the update whose start state the audit aggregator waits for, and its sender
EVIDENCED, CHILD = "evidenced", "child-u"  # the relay push whose evidence the aggregator waits for, and its child
COMMITTER = "d"  # a worker joined at the audit aggregator, whose updates relays commit there (Draw) ...
BREAKER = "e"  # ... and one whose claims break its chain (refused; through a relay that revokes nobody)
STAGE = f"/{serve_pb2.DESCRIPTOR.services_by_name['Serving'].full_name}/"
KEEPS = (1, 41, 410, 4096)  # a sparse codec's values per chunk: 1 … CHUNK
PUSH_CODECS = (Codec.INT8, Codec.SPARSE8, Codec.SPARSE2)  # the codecs of fuzzed pushes' frames


def _spec(block: int = 0) -> dict[str, tuple[int, ...]]:
    return {n: tuple(t.shape) for n, t in init_block(CFG, block, 0).state_dict().items()}


def valid_chunks(rng: random.Random, block: int = 0, codec: Codec | None = None,
                 chunk_bytes: int | None = None) -> list[ChunkData]:
    codec = codec or rng.choice(list(Codec))
    tensors = {n: torch.randn(s, generator=torch.Generator().manual_seed(rng.randrange(2**31))) * 0.01
               for n, s in _spec(block).items()}
    keep, chunk_bytes = rng.choice(KEEPS), chunk_bytes or rng.choice([64, 512, 4096, 1 << 20])
    if rng.random() < 0.5:  # a stream of one bundle (what workers push and aggregators publish), or of frames
        return list(bundle(tensors, codec, keep=keep).chunks(chunk_bytes))
    return list(iter_chunks(encode_frames(tensors, codec, keep=keep), chunk_bytes))


def _junk(rng: random.Random, n: int | None = None) -> bytes:
    return rng.randbytes(rng.choice([0, 1, 7, 64, 1000]) if n is None else n)


def mutate_bundle(rng: random.Random, h: BundleHeader) -> BundleHeader:
    choice = rng.randrange(4)
    if choice == 0:
        return replace(h, codec=rng.choice(list(Codec)))
    if choice == 1:
        return replace(h, tensors=rng.choice([0, h.tensors - 1, h.tensors + 1, 2**31]))
    if choice == 2:
        sizes = list(h.raw_sizes) or [1] * h.tensors
        i = rng.randrange(len(sizes))
        sizes[i] = rng.choice([0, 1, sizes[i] - 1, sizes[i] + 1, 2**40])
        return replace(h, raw_sizes=tuple(rng.choice([sizes, sizes[:-1], []])))
    return replace(h, digest=rng.choice([b"", _junk(rng, 32), h.digest[:31]]))


def mutate_header(rng: random.Random, h: FrameHeader | BundleHeader, names: list[str]) -> FrameHeader | BundleHeader:
    if isinstance(h, BundleHeader):
        return mutate_bundle(rng, h)
    choice = rng.randrange(8)
    if choice == 0:
        return replace(h, name=rng.choice([*names, "", "x" * 300, "layers.0.evil", h.name + "\0"]))
    if choice == 1:
        dims = rng.choice([(), (0,), (-1, 4), (2**40,), tuple(rng.randrange(1, 50) for _ in range(rng.randrange(1, 4)))])
        return replace(h, shape=dims)
    if choice == 2:
        return replace(h, codec=rng.choice(list(Codec)))
    if choice == 3:
        return replace(h, raw_bytes=rng.choice([0, 1, h.raw_bytes - 1, h.raw_bytes + 1, 2**40]))
    if choice == 4:
        return replace(h, payload_bytes=rng.choice([0, 1, h.payload_bytes - 1, h.payload_bytes + 1, 2**40]))
    if choice == 5:
        return replace(h, sha256=rng.choice([b"", _junk(rng, 32), hashlib.sha256(b"x").digest()]))
    if choice == 6:
        return replace(h, dtype=rng.choice(["float16", "int8", "", "float32 "]))
    return h


def mutate_raw(rng: random.Random, raw: bytes) -> bytes:
    """Codec bytes with bits flipped, a byte set to an edge value, cut short or lengthened."""
    data = bytearray(raw)
    op = rng.randrange(4)
    if op == 0 and data:
        for _ in range(rng.randrange(1, 8)):
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    elif op == 1 and data:
        data[rng.randrange(len(data))] = rng.choice([0, 0x80, 0xFF, rng.randrange(256)])
    elif op == 2:
        del data[rng.randrange(len(data) + 1):]
    else:
        data += rng.choice([b"\0", b"\xff", _junk(rng)])
    return bytes(data)


def mutate_chunks(rng: random.Random, chunks: list[ChunkData], names: list[str]) -> list[ChunkData]:
    out = list(chunks)
    for _ in range(rng.randrange(1, 4)):
        if not out:
            out.append(ChunkData(None, _junk(rng)))
            continue
        i = rng.randrange(len(out))
        c = out[i]
        op = rng.randrange(11)
        if op == 0 and c.header is not None:
            out[i] = ChunkData(mutate_header(rng, c.header, names), c.data)
        elif op == 1 and c.data:  # flip bytes of the payload
            data = bytearray(c.data)
            for _ in range(rng.randrange(1, 8)):
                data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
            out[i] = ChunkData(c.header, bytes(data))
        elif op == 2:  # truncate the stream
            out = out[:i]
        elif op == 3:  # drop a chunk
            del out[i]
        elif op == 4:  # duplicate a chunk
            out.insert(i, c)
        elif op == 5:  # swap two chunks
            j = rng.randrange(len(out))
            out[i], out[j] = out[j], out[i]
        elif op == 6:  # junk appended to a payload
            out[i] = ChunkData(c.header, c.data + _junk(rng))
        elif op == 7:  # a header on a continuation chunk, or none on a first chunk
            out[i] = ChunkData(None if c.header is not None else out[0].header, c.data)
        elif op == 8:  # an oversized chunk
            out[i] = ChunkData(c.header, _junk(rng, rng.choice([1 << 20, (1 << 20) + 1, 3 << 20])))
        elif op == 9:  # a frame of NaN or Inf with an honest header and checksum
            bad = {n: torch.full(s, rng.choice([float("nan"), float("inf")])) for n, s in _spec().items()}
            name = rng.choice(list(bad))
            out[i:i + 1] = list(iter_chunks(encode_frames({name: bad[name]}, rng.choice(list(Codec)))))
        else:  # mutated codec bytes under an honest header and checksum, in place of a frame: they reach its decoder
            spec = _spec()
            named = isinstance(c.header, FrameHeader) and c.header.name in spec
            name = c.header.name if named else rng.choice(sorted(spec))
            shape, codec = spec[name], c.header.codec if c.header is not None else rng.choice(list(Codec))
            raw = encode(codec, 0.01 * torch.randn(shape, generator=torch.Generator().manual_seed(rng.randrange(2**31))),
                         keep=rng.choice(KEEPS))
            out[i:i + 1] = list(iter_chunks([frame_from_raw(name, shape, codec, mutate_raw(rng, raw))]))
    return out


def fuzz_frames(seed: int, codec: Codec | None = None) -> str:
    """One frame-decoding case (`codec`: of the valid frames it mutates; drawn if None); returns "ok",
    "refused: <reason>" or raises (a crash)."""
    rng = random.Random(seed)
    spec = _spec()
    chunks = valid_chunks(rng, codec=codec)
    if rng.random() < 0.9:
        chunks = mutate_chunks(rng, chunks, list(spec))
    asm = FrameAssembler.for_spec(spec, list(Codec))
    try:
        for c in chunks:
            asm.add(c)
        got = asm.finish()
    except PeerInputError as err:
        return f"refused: {err.reason}"
    assert set(got) == set(spec) and all(tuple(got[n].shape) == spec[n] for n in spec), "accepted a wrong tensor set"
    assert all(bool(torch.isfinite(t).all()) for t in got.values()), "accepted NaN/Inf"
    return "ok"


def start_state(seed: int = 0) -> dict[str, torch.Tensor]:
    """A start state of block 0 as a worker uploads it for an audit: optimizer (opt.*) and residual (ef.*)."""
    model = init_block(CFG, 0, 0)
    g = torch.Generator().manual_seed(seed)
    shapes = {**{OPTIMIZER_PREFIX + n: s for n, s in optimizer_spec(model).items()},
              **{RESIDUAL_PREFIX + n: tuple(t.shape) for n, t in model.state_dict().items()}}
    return {n: torch.rand(s, generator=g) for n, s in shapes.items()}


def await_state(agg: SwarmAggregator) -> None:
    """Have an audit wait for `start_state()` as the start of update AUDITED (unless one already does)."""
    assert agg.audits is not None
    if agg.audits.waiting_for(AUDITED) is not None:
        return
    state = start_state()
    optim, residual = split_state(state)
    claim = WorkClaim(base_sha256=EMPTY_STATE, data_id="", recipe="{}", optimizer_end=EMPTY_STATE, residual_end=EMPTY_STATE,
                      optimizer_start=state_sha256(optim), residual_start=state_sha256(residual))
    header = PushHeader(worker_id=AUDITEE, block=0, base_version=0, samples=1.0, loss=1.0, codec=Codec.FP32,
                        update_id=AUDITED, claim=claim)
    agg.audits.open(AuditJob(header=header, claim=claim, train=TrainConfig(), raw={}, base={}, arrived=agg.clock(),
                             probation=False))


def evidence_child() -> dict[str, torch.Tensor]:
    """The child update behind the combined push `EVIDENCED` (its frames are the honest evidence)."""
    return {n: torch.full(s, 1e-3) for n, s in _spec().items()}


def await_evidence(agg: SwarmAggregator) -> None:
    """A relay audit waiting for the evidence of `EVIDENCED` (worker "a"'s update `CHILD`, relayed by
    "r"), so that evidence streams reach their checks; opened again once a whole one passed it."""
    assert agg.relay_audits is not None
    if agg.relay_audits.waiting_for(EVIDENCED) is not None:
        return
    child, unit = evidence_child(), agg.block(0).unit
    digest = frames_digest({n: hashlib.sha256(encode(Codec.FP32, t)).digest() for n, t in child.items()})
    acc = Accumulator(_spec(), "all", unit=unit)
    acc.add(child, 1.0)
    header = PushHeader(worker_id="r", block=0, base_version=0, samples=1.0, loss=1.0, codec=Codec.FP32,
                        update_id=EVIDENCED, manifest=(ManifestEntry("a", CHILD, 0, 1.0, digest),))
    agg.relay_audits.open(header, {n: encode(Codec.FP32, acc.mean_of(n)) for n in child})


@dataclass
class Target:
    """A live aggregator (two replicas of block 0 registered, τ long), one with audits on (`audit_agg`,
    for SubmitState) and a live stage, on loopback."""

    address: str
    audit_address: str
    stage_address: str
    agg: SwarmAggregator
    audit_agg: SwarmAggregator
    initial: dict[int, str]
    close: Callable[[], None]
    channel: grpc.Channel = field(init=False)

    def __post_init__(self) -> None:
        self.channel = grpc.insecure_channel(self.address, options=CHANNEL_OPTIONS)
        self.audit_channel = grpc.insecure_channel(self.audit_address, options=CHANNEL_OPTIONS)
        self.stage_channel = grpc.insecure_channel(self.stage_address, options=CHANNEL_OPTIONS)

    def model_changed(self) -> bool:
        """True if some block left version 0 although no update was ever accepted."""
        accepted = sum(n for b in self.agg.blocks.values() for (o, _), n in b.counters.items() if o == "pending")
        moved = any(state_sha256(b.current()[1]) != self.initial[i] for i, b in self.agg.blocks.items())
        return moved and accepted == 0

    def shutdown(self) -> None:
        self.channel.close()
        self.audit_channel.close()
        self.stage_channel.close()
        self.close()


def start_target(state_dir: Path) -> Target:
    rounds = RoundConfig(deadline_s=3600)
    agg = SwarmAggregator(CFG, AggregatorConfig(round=rounds), state_dir)
    terms = TrainingTerms(TrainConfig(), RoundSize().steps_per_round).to_json()  # the aggregator's claims
    for w in ("a", "b"):  # joined, so that their pushes reach the frame decoder (others stop at not_joined)
        agg.join(w, 0, CFG.fingerprint(), json.dumps(CFG.to_dict()), training_json=terms)
    server, port, stop = serve(agg, "127.0.0.1:0")
    audit_agg = SwarmAggregator(CFG, AggregatorConfig(round=rounds, audit=AuditConfig(share=1.0)), state_dir / "audit",
                                corpus=bytes(range(256)) * 4, audit_secret=bytes(32))
    await_state(audit_agg)
    for w in (COMMITTER, BREAKER):  # Draw reaches their chains
        audit_agg.join(w, 0, CFG.fingerprint(), json.dumps(CFG.to_dict()), training_json=terms)
    aserver, aport, astop = serve(audit_agg, "127.0.0.1:0")
    stage = LocalBlockStage(init_block(CFG, 1, 0), 1, CFG.n_blocks, next=None, device=torch.device("cpu"))
    sserver, sport, sstop = serve_stage(stage, "127.0.0.1:0")

    def close() -> None:
        for ev in (stop, astop, sstop):
            ev.set()
        for srv in (server, aserver, sserver):
            srv.stop(0).wait()

    initial = {b: state_sha256(a.current()[1]) for b, a in agg.blocks.items()}
    return Target(f"127.0.0.1:{port}", f"127.0.0.1:{aport}", f"127.0.0.1:{sport}", agg, audit_agg, initial, close)


def _push_messages(rng: random.Random) -> list[bytes]:
    header = swarm_pb2.PushHeader(worker_id=rng.choice(["a", "b", "", "z" * 200]), block=rng.choice([0, 0, 1, 7]),
                                  base_version=rng.choice([0, 0, 1, 2**63]), samples=rng.choice([1.0, 0.0, -1.0,
                                                                                                   float("nan"), 1e308]),
                                  loss=rng.choice([1.0, float("inf")]), codec=rng.choice([*Codec, 0, 99]),
                                  update_id=f"u{rng.randrange(2**32)}")
    codec = Codec(header.codec) if header.codec in set(Codec) else rng.choice(PUSH_CODECS)  # frames of its codec
    chunks = mutate_chunks(rng, valid_chunks(rng, codec=codec, chunk_bytes=rng.choice([256, 1 << 20])), list(_spec()))
    return _stream(rng, header, chunks)


def _state_messages(rng: random.Random) -> list[bytes]:
    """A SubmitState stream: mostly for the update an audit waits for, its state whole or mutated."""
    header = swarm_pb2.PushHeader(worker_id=rng.choice([AUDITEE, AUDITEE, "a", ""]), block=rng.choice([0, 0, 0, 1]),
                                  samples=1.0, codec=1, update_id=rng.choice([AUDITED, AUDITED, "nobody", ""]))
    if rng.random() < 0.3:  # a malformed claim on the header
        header.claim.optimizer_start = _junk(rng)
    state = start_state(seed=0 if rng.random() < 0.5 else rng.randrange(2**31))  # the claimed state, or another
    chunks = list(iter_chunks(encode_frames(state, Codec.FP32), rng.choice([256, 4096, 1 << 20])))
    if rng.random() < 0.7:
        chunks = mutate_chunks(rng, chunks, list(state))
    return _stream(rng, header, chunks)


def _dispute_messages(rng: random.Random, spec: dict[str, tuple[int, ...]]) -> list[bytes]:
    """A SubmitDisputeState stream (no dispute is open): a header, then a whole state of `spec` (RoundReplay's
    state_spec), whole or mutated, now and then with junk inserted or the header left out."""
    header = swarm_pb2.DisputeStateHeader(block=rng.choice([0, 0, 1]), task_id=rng.choice(["t", "", "z" * 300]),
                                          worker_id=rng.choice([AUDITEE, "a", ""]), k=rng.choice([1, 1, 0, 2**31]))
    state = {n: torch.randn(s) for n, s in spec.items()}
    chunks = list(iter_chunks(encode_frames(state, Codec.FP32), rng.choice([256, 1 << 20])))
    if rng.random() < 0.7:
        chunks = mutate_chunks(rng, chunks, list(state))
    msgs = [swarm_pb2.SubmitDisputeStateRequest(header=header).SerializeToString()]
    msgs += [swarm_pb2.SubmitDisputeStateRequest(chunk=convert.chunk_to_pb(c)).SerializeToString() for c in chunks]
    if rng.random() < 0.2:
        msgs.insert(rng.randrange(len(msgs) + 1), _junk(rng))
    return msgs[1:] if rng.random() < 0.1 else msgs


def _draw_request(rng: random.Random, base_sha256: str) -> bytes:
    """A relay's Draw: a child's header (mostly of the joined COMMITTER, with a claim that starts a
    fresh chain on the current version, or of BREAKER, whose claims break its chain) and
    a frames digest, or a mutation of one of them."""
    def pick(good, *bad, p: float = 0.85):
        return good if rng.random() < p else rng.choice(bad)

    claim = WorkClaim(base_sha256=pick(base_sha256, "00" * 32), data_id="", recipe="{}",
                      optimizer_start=EMPTY_STATE, optimizer_end="22" * 32,
                      residual_start=EMPTY_STATE, residual_end=EMPTY_STATE)
    header = swarm_pb2.PushHeader(worker_id=pick(COMMITTER, BREAKER, "a", "", "z" * 300), block=pick(0, 1, 7),
                                  base_version=pick(0, 1, 2**63), samples=pick(2.0, 0.0, float("nan")), loss=1.0,
                                  codec=pick(Codec.INT8, 99), update_id=f"u{rng.randrange(2**32)}", steps=[0, 1])
    if header.worker_id == BREAKER:
        claim = replace(claim, optimizer_start="11" * 32)
    if rng.random() < 0.9:
        header.claim.CopyFrom(convert.claim_to_pb(claim))
    request = swarm_pb2.DrawRequest(header=header, digest=pick(rng.randbytes(32), b"", b"x" * 31))
    data = bytearray(request.SerializeToString())
    if rng.random() < 0.2:
        data[rng.randrange(len(data))] ^= 0xFF
    return bytes(data)


def _evidence_messages(rng: random.Random, unit: float) -> list[bytes]:
    """A SubmitEvidence stream: mostly for the push a relay audit waits for, its evidence whole or mutated."""
    push = swarm_pb2.PushHeader(worker_id=rng.choice(["r", "r", "a", ""]), block=rng.choice([0, 0, 0, 1]), samples=1.0,
                                codec=1, update_id=rng.choice([EVIDENCED, EVIDENCED, "nobody", ""]))
    header = swarm_pb2.EvidenceHeader(push=push, unit=rng.choice([unit, unit, unit, 3.0, 0.0, float("nan")]))
    child = swarm_pb2.EvidenceChild(update_id=rng.choice([CHILD, CHILD, CHILD, "x", ""]),
                                    weight=rng.choice([1.0, 1.0, 1.0, 2.0, -1.0, float("nan")]),
                                    scale=rng.choice([1.0, 1.0, 1.0, 0.5, 0.0, 2.0]), entries=rng.choice([1, 1, 1, 0, 2]))
    chunks = list(iter_chunks(encode_frames(evidence_child(), Codec.FP32), rng.choice([256, 4096, 1 << 20])))
    if rng.random() < 0.5:
        chunks = mutate_chunks(rng, chunks, list(_spec()))
    msgs = [swarm_pb2.SubmitEvidenceRequest(header=header).SerializeToString()]
    if rng.random() < 0.9:
        msgs.append(swarm_pb2.SubmitEvidenceRequest(child=child).SerializeToString())
    msgs += [swarm_pb2.SubmitEvidenceRequest(chunk=convert.chunk_to_pb(c)).SerializeToString() for c in chunks]
    if rng.random() < 0.15:
        msgs.append(swarm_pb2.SubmitEvidenceRequest(child=child).SerializeToString())  # a second child: not listed
    if rng.random() < 0.2:
        msgs.insert(rng.randrange(len(msgs) + 1), _junk(rng))
    if rng.random() < 0.1:
        msgs = msgs[1:]  # no header
    return msgs


def _stream(rng: random.Random, header: swarm_pb2.PushHeader, chunks: list[ChunkData]) -> list[bytes]:
    """A header then chunks, serialised, now and then with junk inserted or the header left out."""
    msgs = [swarm_pb2.PushRequest(header=header).SerializeToString()]
    msgs += [swarm_pb2.PushRequest(chunk=convert.chunk_to_pb(c)).SerializeToString() for c in chunks]
    if rng.random() < 0.2:
        msgs.insert(rng.randrange(len(msgs) + 1), _junk(rng))
    if rng.random() < 0.1:
        msgs = msgs[1:]  # no header
    return msgs


def _random_request(rng: random.Random, message: type) -> bytes:
    """A well-formed message with random field values, or random bytes, or a mutated encoding."""
    roll = rng.random()
    if roll < 0.3:
        return _junk(rng)
    msg = message()
    for f in message.DESCRIPTOR.fields:
        if f.message_type is not None or f.is_repeated:
            continue
        kind = f.cpp_type
        try:
            if kind in (f.CPPTYPE_INT32, f.CPPTYPE_INT64, f.CPPTYPE_UINT32, f.CPPTYPE_UINT64, f.CPPTYPE_ENUM):
                limit = 2**31 - 1 if kind in (f.CPPTYPE_INT32, f.CPPTYPE_ENUM) else 2**32 - 1 if kind == f.CPPTYPE_UINT32 else 2**62
                setattr(msg, f.name, rng.choice([0, 1, 2, 3, limit]))
            elif kind in (f.CPPTYPE_FLOAT, f.CPPTYPE_DOUBLE):
                setattr(msg, f.name, rng.choice([0.0, 1.0, -1.0, float("nan"), float("inf"), 1e30]))
            elif kind == f.CPPTYPE_BOOL:
                setattr(msg, f.name, rng.random() < 0.5)
            elif kind == f.CPPTYPE_STRING:
                setattr(msg, f.name, _junk(rng) if f.type == f.TYPE_BYTES else rng.choice(["", "a", "é" * 50, "b" * 5000]))
        except (ValueError, TypeError):
            pass
    data = bytearray(msg.SerializeToString())
    if roll > 0.8 and data:
        data[rng.randrange(len(data))] ^= 0xFF
    return bytes(data)


SWARM_CALLS = {"Join": (swarm_pb2.JoinRequest, "unary"), "Leave": (swarm_pb2.LeaveRequest, "unary"),
               "Status": (swarm_pb2.StatusRequest, "unary"), "Pull": (swarm_pb2.PullRequest, "stream"),
               "FetchDelta": (swarm_pb2.FetchDeltaRequest, "stream"), "Watch": (swarm_pb2.WatchRequest, "stream"),
               "Push": (None, "push"), "SubmitState": (None, "state"), "SubmitEvidence": (None, "evidence"),
               "Draw": (None, "draw"), "Duties": (swarm_pb2.DutiesRequest, "unary"),
               "VerifyInputs": (swarm_pb2.VerifyInputsRequest, "stream"), "Attest": (swarm_pb2.AttestRequest, "unary"),
               "SubmitTrace": (swarm_pb2.SubmitTraceRequest, "unary"), "SubmitDisputeState": (None, "dispute")}
STAGE_CALLS = {"Info": (serve_pb2.StageInfoRequest, "unary"), "Forward": (serve_pb2.SegmentRequest, "unary"),
               "ForwardAR": (serve_pb2.ARRequest, "unary"), "Generate": (serve_pb2.GenerateRequest, "stream")}


def _swarm_method(name: str) -> str:
    """The path of the aggregator's call `name`, in whichever of its services (Worker, Relay, Operator) holds it."""
    return next(f"/{s.full_name}/{name}" for s in swarm_pb2.DESCRIPTOR.services_by_name.values()
                if name in s.methods_by_name)


def fuzz_rpc(target: Target, seed: int, only: str | None = None) -> str:
    """One RPC case against the live target (`only`: of that swarm call); returns the status code name,
    raises on a crash."""
    rng = random.Random(seed)
    stage = only is None and rng.random() < 0.3
    calls = STAGE_CALLS if stage else SWARM_CALLS
    name = only or rng.choice(sorted(calls))
    message, kind = calls[name]
    channel = (target.stage_channel if stage else target.audit_channel if kind in ("state", "draw", "dispute")
               else target.channel)
    method = STAGE + name if stage else _swarm_method(name)
    ident = lambda b: b  # noqa: E731  (raw bytes on the wire)
    try:
        if kind == "unary":
            channel.unary_unary(method, request_serializer=ident, response_deserializer=ident)(
                _random_request(rng, message), timeout=10)
        elif kind == "draw":
            channel.unary_unary(method, request_serializer=ident, response_deserializer=ident)(
                _draw_request(rng, target.audit_agg.block(0).current()[0].sha256), timeout=10)
        elif kind == "stream":
            call = channel.unary_stream(method, request_serializer=ident, response_deserializer=ident)(
                _random_request(rng, message), timeout=0.5 if name == "Watch" else 10)
            for i, _ in enumerate(call):
                if i > 200:
                    call.cancel()
                    break
        else:
            if kind == "state":
                await_state(target.audit_agg)  # a case before may have failed the audit, or passed its state
            if kind == "evidence":
                await_evidence(target.agg)  # a case before may have passed it
            messages = (_push_messages(rng) if kind == "push" else _state_messages(rng) if kind == "state"
                        else _dispute_messages(rng, target.audit_agg.replayers[0].replay.state_spec())
                        if kind == "dispute" else _evidence_messages(rng, target.agg.block(0).unit))
            channel.stream_unary(method, request_serializer=ident, response_deserializer=ident)(iter(messages),
                                                                                                timeout=10)
        return "OK"
    except grpc.RpcError as err:
        code = err.code()
        if code in REFUSALS or code == grpc.StatusCode.CANCELLED:
            return code.name
        raise AssertionError(f"{method} seed {seed}: {code.name}: {err.details()}") from None
