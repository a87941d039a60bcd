"""`LocalLink`: an Upstream that calls a SwarmAggregator in the same process.

Pushes still go through the wire format (frames compressed by the worker, then chunked and
validated by the aggregator's own FrameAssembler), so the only thing replaced is the network.
Pulls hand over the tensors directly; their Transfer counts fp32 bytes (nothing is compressed
in-process). A link built with `who` carries that proven identity, as mutual TLS would: its joins
and pushes are bound to it, and a push under another worker id is refused as the RPC layer refuses it."""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import replace

import torch

from btnode.aggregate.service import SwarmAggregator
from btnode.aggregate.trust.identities import Identity, Role
from btnode.codec.codecs import Codec, decode
from btnode.codec.frames import ChunkData, Frame, FrameAssembler, iter_chunks
from btnode.protocol import (Attestation, Duties, JoinInfo, Judgement, Pulled, PushHeader, RoundReceipt, Transfer,
                             VersionInfo)

Spec = Mapping[str, tuple[int, ...]]
Tensors = dict[str, torch.Tensor]


class LocalLink:
    def __init__(self, agg: SwarmAggregator, who: Identity | None = None):
        self.agg = agg
        self.who = who
        self._ended: set[str] = set()  # workers whose watch streams were cancelled

    def join(self, worker_id: str, block: int, fingerprint: str, config_json: str, data_id: str = "", *,
             training_json: str = "") -> JoinInfo:
        if self.who is not None:
            self.agg.admit(self.who, "Join", worker_id)
        return self.agg.join(worker_id, block, fingerprint, config_json, data_id, self.who, training_json=training_json)

    def leave(self, worker_id: str, block: int) -> None:
        self.agg.leave(worker_id, block)

    def pull(self, block: int, worker_id: str, spec: Spec) -> Pulled:
        info, params = self.agg.block(block).current()
        size = sum(4 * math.prod(s) for s in spec.values())
        return Pulled(info=info, tensors={n: params[n].clone() for n in spec}, transfer=Transfer(raw=size, wire=size))

    def fetch_delta(self, block: int, version: int, spec: Spec) -> Pulled:
        info, codec, raw = self.agg.block(block).delta(version)
        size = sum(len(b) for b in raw.values())
        return Pulled(info=info, tensors={n: decode(codec, raw[n], spec[n]) for n in spec},
                      transfer=Transfer(raw=size, wire=size))

    def push(self, header: PushHeader, frames: Iterable[Frame]) -> Judgement:
        if self.who is not None and header.worker_id != self.who.name:  # (a revoked name: push refuses it itself)
            self.agg.admit(self.who, "Push", header.worker_id)
        return self.agg.push(header, iter_chunks(frames), who=self.who)

    def submit_state(self, header: PushHeader, frames: Iterable[Frame]) -> None:
        self.agg.submit_state(header, iter_chunks(frames))

    def watch(self, block: int, worker_id: str) -> Iterator[VersionInfo]:
        agg = self.agg.block(block)
        seen = -1
        self._ended.discard(worker_id)
        while worker_id not in self._ended:
            info = agg.wait_for(seen, timeout=1.0)
            if info is not None:
                seen = info.version
                yield info

    def receipt(self, block: int, worker_id: str, update_id: str) -> RoundReceipt | None:
        return self.agg.block(block).receipt(worker_id, update_id)

    def states_wanted(self, block: int, worker_id: str) -> tuple[str, ...]:
        return self.agg.replays.wanted(worker_id)

    def duties_waiting(self, block: int, worker_id: str) -> bool:
        return self.agg.delegated is not None and bool(self.agg.delegated.duties.get(self._me(worker_id)))

    def duties(self, block: int, worker_id: str) -> Duties:
        return self.agg.duties(self._me(worker_id))

    def verify_inputs(self, block: int, task_id: str, worker_id: str) -> tuple[Mapping[str, torch.Tensor], Tensors]:
        base, start = self.agg.verify_inputs(block, task_id, self._me(worker_id))
        return dict(base), {n: t.clone() for n, t in start.items()}

    def attest(self, block: int, attestation: Attestation) -> None:
        self.agg.attest(block, replace(attestation, verifier=self._me(attestation.verifier)))

    def submit_trace(self, block: int, task_id: str, worker_id: str, trace: tuple[str, ...], *,
                     proof: tuple[bytes, bytes] | None = None) -> None:
        self.agg.submit_trace(block, task_id, self._me(worker_id), trace)

    def submit_dispute_state(self, block: int, task_id: str, worker_id: str, k: int,
                             state: Mapping[str, torch.Tensor] | Iterable[ChunkData]) -> None:
        if not isinstance(state, Mapping):  # a relay passing a child's on, as it came
            asm = FrameAssembler.for_spec(self.agg.replayers[block].replay.state_spec(), [Codec.FP32])
            for chunk in state:
                asm.add(chunk)
            state = asm.finish()  # type: ignore[assignment] - fp32 frames: dense tensors
        self.agg.submit_dispute_state(task_id, self._me(worker_id), k, state)

    def _me(self, worker_id: str) -> str:
        """The caller's name: its proven identity's when it has one (as under mutual TLS), else what it says;
        a relay's child's when a relay calls for a child that pushes through it (as rpc/verification.py admits)."""
        if self.who is None:
            return worker_id
        if self.who.role is Role.RELAY and self.agg.relays_for(worker_id) == self.who.name:
            return worker_id
        return self.who.name

    def cancel_watches(self, worker_id: str) -> None:
        self._ended.add(worker_id)  # its watch loop returns within a second

    def close(self) -> None:
        pass
