"""`SwarmAggregator`: the aggregator role's domain object. It owns a set of blocks (all of them,
or a disjoint share when several aggregators split the model), admits workers whose run
fingerprint matches, and answers status. rpc/server.py is a thin layer over it.

In a DiLoCo run (ModelConfig.kind "ar") it owns one unit, block 0, which is the whole AR model:
the same BlockAggregator, rounds, outer step and version store, only another init (init_unit)."""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from btnode.aggregate.block import AggregatorConfig, BlockAggregator, BlockStatus
from btnode.codec.frames import ChunkData, FrameAssembler
from btnode.errors import ConfigError, ConfigMismatchError, MalformedInput, PeerInputError, UnknownBlock
from btnode.model.config import ModelConfig
from btnode.protocol import JoinInfo, Judgement, Meter, PushHeader, VersionInfo
from btnode.store.files import atomic_write
from btnode.store.models import RUN_FILE, init_unit, unit_stem
from btnode.store.versions import VersionStore

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SwarmStatus:
    """What `SwarmAggregator.status` answers: each owned block's `BlockStatus` (each read under its
    own lock, one after the other) and the swarm-wide event counts."""

    fingerprint: str
    config: ModelConfig
    blocks: tuple[BlockStatus, ...]  # by block number
    events: Mapping[tuple[str, str], int]  # (event, reason) → count, for events outside one block


class SwarmAggregator:
    def __init__(self, cfg: ModelConfig, acfg: AggregatorConfig, state_dir: Path, *, blocks: Iterable[int] | None = None,
                 seed: int = 0, clock: Callable[[], float] = time.time):
        self.cfg = cfg
        self.acfg = acfg
        self.fingerprint = cfg.fingerprint()
        owned = sorted(set(range(cfg.total_blocks) if blocks is None else blocks))
        if not owned or any(not 0 <= b < cfg.total_blocks for b in owned):
            raise ConfigError(f"blocks {owned} out of range for {cfg.total_blocks} blocks")
        state_dir.mkdir(parents=True, exist_ok=True)
        self._check_state_dir(state_dir)
        self.blocks = {b: BlockAggregator(b, init_unit(cfg, b, seed).state_dict(),
                                          VersionStore(state_dir, b, keep=acfg.keep, stem=unit_stem(cfg, b)), acfg,
                                          clock=clock, name=cfg.unit_name(b))
                       for b in owned}
        self.counters: Counter = Counter()  # (name, reason) for events outside one block
        self.meter = Meter()  # bytes by (direction, form) and call durations, for metrics

    def count(self, event: str, reason: str = "") -> None:
        """Count an event outside any one block (a refused join, an unauthenticated or limited call)."""
        self.counters[(event, reason)] += 1

    def status(self) -> SwarmStatus:
        blocks = tuple(self.blocks[b].status() for b in sorted(self.blocks))
        return SwarmStatus(fingerprint=self.fingerprint, config=self.cfg, blocks=blocks, events=dict(self.counters))

    def _check_state_dir(self, state_dir: Path) -> None:
        """A state folder belongs to one run: refuse to mix versions of different configurations."""
        marker = state_dir / RUN_FILE
        if marker.exists():
            theirs = ModelConfig.from_dict(json.loads(marker.read_text())["model"])
            self.cfg.require_same(theirs, f"state folder {state_dir}")
        else:
            atomic_write(marker, json.dumps({"model": self.cfg.to_dict(), "fingerprint": self.fingerprint},
                                            indent=1).encode())

    def block(self, b: int) -> BlockAggregator:
        agg = self.blocks.get(b)
        if agg is None:
            raise UnknownBlock("unknown_block", f"this aggregator owns blocks {sorted(self.blocks)}, not block {b}")
        return agg

    def join(self, worker_id: str, block: int, fingerprint: str, config_json: str) -> JoinInfo:
        if fingerprint != self.fingerprint:
            self.count("join_refused", "fingerprint")
            try:
                theirs = ModelConfig.from_dict(json.loads(config_json))
            except (ValueError, TypeError, ConfigError):
                raise ConfigMismatchError(f"worker {worker_id!r} has run fingerprint {fingerprint[:12]}…, this swarm "
                                          f"runs {self.fingerprint[:12]}… (its settings could not be read)", []) from None
            fields = self.cfg.diff(theirs)
            detail = ", ".join(f"{k}: swarm has {ours!r}, worker has {t!r}" for k, ours, t in fields) or "fingerprint format"
            raise ConfigMismatchError(f"worker {worker_id!r} runs different swarm-wide settings ({detail})", fields)
        agg = self.block(block)
        agg.register(worker_id)
        self.count("joins")
        log.info("worker %s joined %s", worker_id, self.cfg.unit_name(block))
        return JoinInfo(current=agg.current()[0], deadline_s=self.acfg.round.deadline_s, codecs=self.acfg.update_codecs,
                        max_staleness=self.acfg.round.max_staleness)

    def leave(self, worker_id: str, block: int) -> None:
        self.block(block).unregister(worker_id)
        log.info("worker %s left %s", worker_id, self.cfg.unit_name(block))

    def push(self, header: PushHeader, chunks: Iterable[ChunkData]) -> Judgement:
        """Judge one pushed update: its header first (re-push, late, stale answered before any
        payload), then every frame validated against the block's spec, then the round's rules.
        A refused push is counted with its reason and raised; nothing of it is applied."""
        try:
            block = self.block(header.block)
        except PeerInputError as exc:  # no block to charge it to: count it swarm-wide
            self.count("rejected", exc.reason)
            raise
        try:
            early = block.precheck(header)
            if early is not None:
                return early
            if header.codec not in self.acfg.update_codecs:
                raise MalformedInput("codec", f"codec {header.codec.name} is not accepted here")
            asm = FrameAssembler.for_spec(block.spec, [header.codec])
            try:
                for chunk in chunks:
                    asm.add(chunk)
                delta = asm.finish()
            finally:
                self.meter.count(("received", "wire"), asm.wire_bytes)
                self.meter.count(("received", "raw"), sum(len(b) for b in asm.raw.values()))
        except PeerInputError as exc:
            block.reject(header, exc)
            raise
        return block.submit(header, delta)

    def drain(self) -> list[VersionInfo]:
        """Publish every open round that accepted updates (see BlockAggregator.drain)."""
        return [info for agg in self.blocks.values() if (info := agg.drain()) is not None]

    def tick(self) -> None:
        for agg in self.blocks.values():
            agg.tick()
