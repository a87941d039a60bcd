"""`JoinDesk`: who may join a block, and on what terms (docs/swarm.md): a worker whose run fingerprint,
data and training settings match the swarm's, not revoked, gets its data key; a relay joins to push
its children's combined updates. At a relay the parent judges a worker's join first."""

from __future__ import annotations

import json
import logging
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import replace

from btnode.aggregate.relay.admission import ParentKeys, UpstreamAdmission
from btnode.aggregate.round.block import BlockAggregator
from btnode.aggregate.round.config import AggregatorConfig
from btnode.aggregate.trust.audit import Audits
from btnode.aggregate.trust.datakeys import DataKeys
from btnode.aggregate.trust.identities import Identities, Identity
from btnode.aggregate.trust.manifests import Relays
from btnode.aggregate.trust.terms import TrainingRecords
from btnode.errors import ConfigError, ConfigMismatchError, Forbidden, MalformedInput, Refused
from btnode.model.config import ModelConfig
from btnode.protocol import MAX_NAME, JoinInfo
from btnode.train.terms import TrainingTerms

log = logging.getLogger(__name__)


class JoinDesk:
    """The joins of one aggregator, with what they read and record: the swarm's settings, the blocks
    (`block`), identities, data keys, training terms and relays, the replay audits a rejoin may
    abandon (`abandoned`), the parent at a relay (`upstream`) and the swarm's event counts (`count`)."""

    def __init__(self, cfg: ModelConfig, acfg: AggregatorConfig, *, block: Callable[[int], BlockAggregator],
                 identities: Identities, keys: DataKeys | ParentKeys, terms: TrainingRecords, relays: Relays,
                 audits: Audits | None, abandoned: Callable[[str, int], None], relay_audits: bool,
                 upstream: UpstreamAdmission | None, count: Callable[..., None]):
        self.cfg, self.acfg, self.fingerprint = cfg, acfg, cfg.fingerprint()
        self._block, self.identities, self.keys, self.terms, self.relays = block, identities, keys, terms, relays
        self.audits, self._abandoned, self.relay_audits = audits, abandoned, relay_audits
        self.upstream, self._count = upstream, count
        self._pending: Counter[tuple[int, str]] = Counter()  # (block, worker id) → its joins under way here
        self._pending_lock = threading.Lock()

    def pending(self, block: int, worker_id: str) -> bool:
        """Whether a join of `worker_id` to `block` is under way here (at a relay: gone to the parent and
        not back): a call of that worker now is refused for now (JoinPending), not for good."""
        with self._pending_lock:
            return self._pending[(block, worker_id)] > 0

    def join(self, worker_id: str, block: int, fingerprint: str, config_json: str, data_id: str = "",
             who: Identity | None = None, *, training_json: str = "", relay: bool = False,
             proof: tuple[bytes, bytes] | None = None, via: str = "") -> JoinInfo:
        """Admit a worker whose fingerprint, stated data id (empty: not stated) and training settings
        (`training_json`, TrainingTerms) match the swarm's, and hand it its data key. `who`: its proven
        identity, under mutual TLS (the RPC layer has checked that `worker_id` is its name, or the
        worker's signature on a join a relay passed on). `proof`: that certificate and signature, which
        a relay passes on to its parent (relay/admission.py). `via`: the child relay that passed the
        join on ("": the worker joins itself), which the block keeps (Replicas.via)."""
        key = (block, worker_id)
        with self._pending_lock:
            self._pending[key] += 1
        try:
            return self._join(worker_id, block, fingerprint, config_json, data_id, who, training_json=training_json,
                              relay=relay, proof=proof, via=via)
        finally:
            with self._pending_lock:
                self._pending[key] -= 1
                if self._pending[key] <= 0:
                    del self._pending[key]

    def _join(self, worker_id: str, block: int, fingerprint: str, config_json: str, data_id: str,
              who: Identity | None, *, training_json: str, relay: bool, proof: tuple[bytes, bytes] | None,
              via: str) -> JoinInfo:
        if self.upstream is None:
            return self._admit(worker_id, block, fingerprint, config_json, data_id, who, training_json, relay, via)
        # a relay: the parent judges a worker's join first (fingerprint, data, training terms, revocation)
        # and keeps the record; then the relay admits the child with the same checks and the parent's data
        # key. A child relay joins here only: the parent knows the workers under it from their own joins
        # and sees their updates in this relay's manifests, so it does not wait on the child relay.
        self._block(block)
        if relay:
            try:
                self.upstream.refuse_child_relay()
            except Refused:
                self._count("join_refused", "relay")
                raise
            return self._admit(worker_id, block, fingerprint, config_json, data_id, who, "", True)
        parent = self.upstream.join(worker_id, block, fingerprint, config_json, data_id, training_json=training_json,
                                    proof=proof)
        mine = self._admit(worker_id, block, fingerprint, config_json, data_id, who, training_json, False, via)
        return replace(mine, data_key=parent.data_key, audits=parent.audits)  # a worker keeps its start states

    def _admit(self, worker_id: str, block: int, fingerprint: str, config_json: str, data_id: str,
               who: Identity | None, training_json: str, relay: bool, via: str = "") -> JoinInfo:
        if not worker_id or len(worker_id) > MAX_NAME or len(data_id) > MAX_NAME or len(via) > MAX_NAME:
            raise MalformedInput("join", f"a join needs a worker id, and ids of at most {MAX_NAME} characters")
        if self.identities.is_revoked(worker_id):
            self._count("join_refused", "revoked")
            raise Forbidden("revoked", f"worker {worker_id!r} was revoked (a failed audit or the operator): it may not "
                                       f"join again under this name")
        if fingerprint != self.fingerprint:
            self._count("join_refused", "fingerprint")
            try:
                theirs = ModelConfig.from_dict(json.loads(config_json))
            except (ValueError, TypeError, ConfigError):
                raise ConfigMismatchError(f"worker {worker_id!r} has run fingerprint {fingerprint[:12]}…, this swarm "
                                          f"runs {self.fingerprint[:12]}… (its settings could not be read)", []) from None
            fields = self.cfg.diff(theirs)
            raise ConfigMismatchError(f"worker {worker_id!r} runs different swarm-wide settings "
                                      f"({_named(fields) or 'fingerprint format'})", fields)
        agg = self._block(block)
        if relay:
            return self._join_relay(agg, worker_id, who)
        terms = self._check_training(worker_id, training_json)
        try:
            key = self.keys.assign(block, worker_id, data_id)
        except ConfigMismatchError:
            self._count("join_refused", "data")
            raise
        if self.audits is not None and (over := self.audits.joined(block, worker_id)) is not None:
            self._abandoned(worker_id, over)
        agg.register(worker_id, via)
        if terms is not None:
            self.terms.record(worker_id, terms)
        if who is not None:
            self.identities.joined(who, block)
        self._count("joins")
        log.info("worker %s joined %s with data key %s", worker_id, self.cfg.unit_name(block), key)
        return JoinInfo(current=agg.current()[0], deadline_s=self.acfg.round.deadline_s, codecs=self.acfg.update_codecs,
                        max_staleness=self.acfg.round.max_staleness, data_key=key, audits=self.audits is not None)

    def _join_relay(self, agg: BlockAggregator, name: str, who: Identity | None) -> JoinInfo:
        """A relay joins a block to push its children's combined updates: it trains nothing, so it has
        no data key and no training terms; its children join through it, one by one. Under replay
        audits it commits each child update here before it counts it (`draw`)."""
        self.relays.joined(agg.block, name)  # not a replica: the round waits on the workers it reports for
        if who is not None:
            self.identities.joined(who, agg.block)
        self._count("joins", "relay")
        log.info("relay %s joined %s", name, agg.name)
        return JoinInfo(current=agg.current()[0], deadline_s=self.acfg.round.deadline_s, codecs=self.acfg.update_codecs,
                        max_staleness=self.acfg.round.max_staleness, audits=self.audits is not None,
                        relay_audits=self.relay_audits)

    def _check_training(self, worker_id: str, training_json: str) -> TrainingTerms | None:
        """The worker's training terms, once their swarm-wide settings match the claims this
        aggregator judges by; under --believe-claims they are only read, to be recorded."""
        claims = self.acfg.claims
        try:
            if not training_json:
                if claims.enforce:
                    raise ConfigMismatchError(f"worker {worker_id!r} states no training settings (an older worker): "
                                              f"its claims cannot be checked against this swarm's batch, lr and H "
                                              f"(an aggregator started with --believe-claims admits it)", [])
                return None
            terms = TrainingTerms.from_json(training_json)
            fields = claims.differences(terms) if claims.enforce else []
            if fields:
                raise ConfigMismatchError(f"worker {worker_id!r} trains with different swarm-wide settings "
                                          f"({_named(fields)})", fields)
        except (ConfigMismatchError, MalformedInput):
            self._count("join_refused", "training")
            raise
        return terms

def _named(fields: list[tuple[str, object, object]]) -> str:
    """Differing settings for a refusal: "batch: swarm has 16, worker has 8, ..."."""
    return ", ".join(f"{k}: swarm has {ours!r}, worker has {theirs!r}" for k, ours, theirs in fields)
