"""A relay in the simulator (docs/relays.md): the daemon's own relay aggregator (a SwarmAggregator built
with an UpstreamAdmission) under the root, driven as node/relay.py drives it but on the simulator's
clock and event queue: it joins the root as a relay, adopts the root's versions (`hear`), and pushes
each closed round's combined update up (`forward`), with its evidence when the root draws it for a
relay audit. Its children's drawn updates and start states go up through the admission itself."""

from __future__ import annotations

import json
import logging
import random
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from btnode.aggregate.relay.admission import UpstreamAdmission
from btnode.aggregate.relay.forward import Combined, RelayBlock
from btnode.aggregate.round.config import AggregatorConfig
from btnode.aggregate.service import SwarmAggregator
from btnode.aggregate.trust.identities import Role
from btnode.aggregate.trust.manifests import counted_in
from btnode.codec.codecs import Codec
from btnode.codec.frames import lazy_frames
from btnode.errors import BtnodeError, Forbidden
from btnode.model.config import ModelConfig
from btnode.protocol import Judgement, Outcome, PushHeader, VersionInfo
from btnode.sim.link import ChildLink, LocalCA, ParentLink, identity
from btnode.store.files import state_sha256

log = logging.getLogger(__name__)


class SimRelay:
    """Relay `name` under `root`, for all of its blocks. `ca`: children sign what the relay passes on
    and the relay calls the root under its own identity (None: no mutual TLS, no identities).
    `margin`: seconds before the root's deadline that its rounds close (default a quarter, as
    node/relay.py). `amend_safety_s`: how long before the root's deadline an amendment must go up."""

    def __init__(self, name: str, root: SwarmAggregator, cfg: ModelConfig, acfg: AggregatorConfig, state_dir: Path, *,
                 seed: int, clock: Callable[[], float], ca: LocalCA | None, margin: float | None = None,
                 amend_safety_s: float = 0.0):
        self.name, self.clock, self.amend_safety_s = name, clock, amend_safety_s
        self.parent = ParentLink(root, identity(name, Role.RELAY) if ca is not None else None, ca)
        joined = [self.parent.join(name, b, cfg.fingerprint(), json.dumps(cfg.to_dict()), relay=True)
                  for b in sorted(root.blocks)]
        parent_deadline = joined[0].deadline_s
        own = parent_deadline - (parent_deadline / 4 if margin is None else margin)
        acfg = replace(acfg, round=replace(acfg.round, deadline_s=own, max_staleness=joined[0].max_staleness),
                       update_codecs=tuple(c for c in acfg.update_codecs if c in joined[0].codecs))
        self.admission = UpstreamAdmission(self.parent, name, parent_audits=any(j.relay_audits for j in joined),
                                           parent_replays=any(j.audits for j in joined),
                                           check_receipt=ca.check_receipt if ca is not None else None)
        self.agg = SwarmAggregator(cfg, acfg, state_dir, blocks=sorted(root.blocks), seed=seed, clock=clock,
                                   upstream=self.admission)
        for b in self.blocks.values():  # from the root's current version (hash-checked by adopt)
            pulled = self.parent.pull(b.block, "", b.spec)
            if b.current()[0].sha256 != pulled.info.sha256:
                b.adopt(pulled.info, pulled.tensors, raw=None, codec=None)
        self.children: list[ChildLink] = []  # its children's links (their calls here are its work)
        self.pending: dict[tuple[int, int], Combined] = {}  # (block, round) → the newest combined update to push
        self.judged: dict[str, int] = {}  # the root's outcome → combined pushes
        self.refused = False  # the root refuses this relay (revoked): it forwards nothing more
        self.seconds = 0.0  # time in its own calls (adopting, ticking, forwarding), the root's calls included
        self._ids = random.Random(f"relay-update-ids/{seed}/{name}")  # one seed, one run

    @property
    def blocks(self) -> dict[int, RelayBlock]:
        return self.admission.blocks

    def cpu_s(self) -> float:
        """Time in the relay's code: its children's calls to it and its own, less its calls to the root."""
        return self.seconds + sum(c.seconds for c in self.children) - self.parent.seconds

    # -- the root's versions ----------------------------------------------------------------------------
    def hear(self, info: VersionInfo) -> bool:
        """Adopt the root's version `info` (node/relay.py `_fetch`): its delta onto our θ when it builds on
        it, else a full pull, each hash-checked. Returns whether it was new here."""
        t0 = time.perf_counter()
        try:
            block = self.blocks[info.block]
            have, params = block.current()
            if info.version <= have.version:
                return False
            if info.base_version == have.version:
                got = self.parent.fetch_delta(block.block, info.version, block.spec)
                new = {n: params[n] + got.tensors[n] for n in params}
                if state_sha256(new) == info.sha256 == got.info.sha256:
                    block.adopt(info, new, raw=got.raw, codec=got.info.delta_codec)
                    return True
                log.warning("%s %s v%d: the delta fails the announced hash; pulling in full", self.name, block.name,
                            info.version)
            pulled = self.parent.pull(block.block, "", block.spec)
            block.adopt(pulled.info, pulled.tensors, raw=None, codec=None)
            return True
        finally:
            self.seconds += time.perf_counter() - t0

    def tick(self, b: int) -> None:
        t0 = time.perf_counter()
        self.blocks[b].tick()
        self.seconds += time.perf_counter() - t0

    # -- combined updates -------------------------------------------------------------------------------
    def collect(self) -> bool:
        """Closed rounds from the outbox into `pending`, the newest of each round only (an amendment
        takes the place of the one before it: node/relay.py `_latest`). Returns whether any came."""
        came = False
        while not self.admission.outbox.empty():
            c = self.admission.outbox.get_nowait()
            self.pending[(c.block, c.base_version)] = c
            came = True
        return came

    def forward(self) -> list[Judgement]:
        """Push every pending combined update to the root (node/relay.py `_forward`); the root's answers."""
        t0 = time.perf_counter()
        pending, self.pending = self.pending, {}
        out = []
        try:
            for _, c in sorted(pending.items()):
                if self.refused:
                    break
                out.append(self._forward(c))
        finally:
            self.seconds += time.perf_counter() - t0
        return [j for j in out if j is not None]

    def _forward(self, c: Combined) -> Judgement | None:
        header = PushHeader(worker_id=self.name, block=c.block, base_version=c.base_version, samples=c.weight,
                            loss=c.loss, codec=Codec.FP32, update_id=f"{self._ids.getrandbits(128):032x}",
                            manifest=c.manifest)
        self.admission.last_forward[c.block] = (header, c)
        try:
            j = self.parent.push(header, lazy_frames(c.delta, Codec.FP32))
        except Forbidden as exc:  # revoked at the root: its children's updates go nowhere now
            log.error("relay %s: the root refuses it (%s): %d child updates not forwarded", self.name, exc,
                      len(c.manifest))
            self.refused = True
            return None
        self.judged[j.outcome.value] = self.judged.get(j.outcome.value, 0) + 1
        self.admission.forwarded[j.outcome.value] = self.admission.forwarded.get(j.outcome.value, 0) + 1
        block = self.blocks[c.block]
        if j.closes_in_s > 0:  # amendments go up while they can reach the root's round
            block.parent_closes(c.base_version, self.clock() + j.closes_in_s - self.amend_safety_s)
        counted = counted_in(j.reason) if j.outcome is Outcome.REJECTED else frozenset()
        if counted:
            block.uncount(counted)
        if j.audit:  # drawn for a relay audit: its children's frames, from which the root recombines it
            try:
                self.parent.submit_evidence(header, block.unit, self.admission.evidence(c))
            except BtnodeError as exc:
                log.error("relay %s block %d round %d: evidence refused: %s", self.name, c.block, c.base_version, exc)
        return j

    def lost(self) -> int:
        """Accepted child updates never forwarded (the root moved on first)."""
        return self.admission.lost()
