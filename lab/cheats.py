"""Cheating workers (issue #23), for tests and bench/cheats.py: each is a `BlockWorker` that changes
what it pushes or what it trains on, while its claims look honest (the steps it lists, and samples
= len(steps) × batch, as an honest worker states them). The simulator hosts them by worker id
(`Simulation(..., workers={id: factory})`); a factory takes BlockWorker's constructor arguments.

`CHEATS` names every cheat of one replica; `cheat_factory(name, victim=...)` builds one. `ATTACKS` names the
attacks of several identities acting as one (a Sybil, colluding sleepers): `attack_workers(name, ids)` builds
one worker per identity, all sharing one `Attacker`. `VERIFIER_CHEATS` lie as verifiers (delegated
verification, aggregate/trust/delegate.py): one that accuses honest rounds, and a pair (`verifier_workers`)
whose verifier vouches for its partner's forged updates."""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import partial

import torch

from btnode.codec.codecs import decode
from btnode.codec.frames import encode_raw
from btnode.data.source import ByteSource
from btnode.errors import Forbidden
from btnode.protocol import Judgement, PushHeader, VerifyTask
from btnode.swarm.verify import Verification
from btnode.swarm.worker import BlockWorker
from btnode.train.replay import ReplayResult, result_digest

Tensors = dict[str, torch.Tensor]
Raw = dict[str, bytes]
LAZY_STEPS = 5  # what the lazy worker really trains of its H
SCALE = 100.0  # the scaled cheat's factor
SYBILS = 2  # extra ids the sybil pushes under
SENTENCE = b"The cat sat on the mat. "
SLEEP = 4  # a sleeper's honest rounds (base versions 0..SLEEP-1): past a probation of 2 audits at any p


class ForgingWorker(BlockWorker):
    """Trains honestly, then pushes `forge(Δ)` in place of its Δ, under the honest header."""

    def forge(self, delta: Tensors) -> Tensors:
        raise NotImplementedError

    def make_update(self) -> tuple[PushHeader, Raw]:
        header, raw = super().make_update()
        delta = {n: decode(self.wcfg.codec, raw[n], self.spec[n]) for n in self.spec}
        self._last_update = (header, encode_raw(self.forge(delta), self.wcfg.codec))
        return self._last_update


class ZeroWorker(ForgingWorker):
    """Withholds its work: pushes a zero delta (an update that moves nothing, paid as H steps)."""

    def forge(self, delta: Tensors) -> Tensors:
        return {n: torch.zeros_like(d) for n, d in delta.items()}


class NegatedWorker(ForgingWorker):
    """Pushes −Δ: a sign flip at the honest size (the same cheat once claims fix the weight)."""

    def forge(self, delta: Tensors) -> Tensors:
        return {n: -d for n, d in delta.items()}


class ScaledWorker(ForgingWorker):
    """Pushes SCALE × Δ: the per-coordinate claim bound refuses it."""

    def forge(self, delta: Tensors) -> Tensors:
        return {n: SCALE * d for n, d in delta.items()}


class ReplayOwnWorker(ForgingWorker):
    """Pushes its round-0 delta again every round."""

    first: Tensors | None = None

    def forge(self, delta: Tensors) -> Tensors:
        if self.first is None:
            self.first = delta
        return self.first


class ReplayPublishedWorker(ForgingWorker):
    """Pushes the block's latest published delta (which any worker can fetch) as its own; zero before
    anything was published."""

    def forge(self, delta: Tensors) -> Tensors:
        assert self.info is not None
        if self.info.version == 0:
            return {n: torch.zeros_like(d) for n, d in delta.items()}
        return self.link.fetch_delta(self.wcfg.block, self.info.version, self.spec).tensors


class LazyWorker(BlockWorker):
    """Trains LAZY_STEPS of the steps due and lists them all: its step counter and the steps it
    claims move as an honest worker's would."""

    def train_steps(self, n: int) -> None:
        super().train_steps(min(n, LAZY_STEPS))
        skip(self, n - min(n, LAZY_STEPS))


class FreeRiderWorker(ForgingWorker):
    """Trains nothing, lists H steps, and pushes a tiny random delta (N(0, (lr/10)²) per
    coordinate, far inside the bound): the cheapest update that is not exactly zero."""

    def train_steps(self, n: int) -> None:
        skip(self, n)

    def forge(self, delta: Tensors) -> Tensors:
        g = torch.Generator().manual_seed(self.trainer.step)
        return {n: torch.randn(d.shape, generator=g) * (self.tc.lr / 10) for n, d in delta.items()}


class CopyingWorker(ForgingWorker):
    """Pushes another replica's update of the same round as its own (its bytes, read off the wire:
    in the simulator, the victim's last made update)."""

    def __init__(self, *args: object, victim: Callable[[], BlockWorker], **kwargs: object):
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.victim = victim

    def forge(self, delta: Tensors) -> Tensors:
        return delta  # replaced at push time, when the victim's update of this round exists

    def push(self, header: PushHeader, raw: Raw) -> Judgement:
        theirs = self.victim()._last_update
        if theirs is not None and theirs[0].base_version == header.base_version:
            raw = theirs[1]
        return super().push(header, raw)


class SybilWorker(NegatedWorker):
    """Pushes −Δ under its own id and under SYBILS more ids that never joined (stating no data key,
    as an older worker may), so that bad updates outnumber the honest ones."""

    def push(self, header: PushHeader, raw: Raw) -> Judgement:
        for i in range(SYBILS):
            fake = replace(header, worker_id=f"{self.wcfg.worker_id}-sybil{i}", update_id=uuid.uuid4().hex, data_key="")
            try:
                super().push(fake, raw)
            except Forbidden:  # under identities a certificate pushes under its own name only: it goes on
                pass
        return super().push(header, raw)


@dataclass(frozen=True)
class Attack:
    """Several identities acting as one: `ids` of them train honestly, and in the rounds (base
    versions) from `start` up to `stop` (None: to the end) each pushes the same −(mean of their honest
    deltas of that round), under its own honest header."""

    ids: int
    start: int = 0
    stop: int | None = None

    def turned(self, version: int) -> bool:
        return self.start <= version and (self.stop is None or version < self.stop)


@dataclass
class Attacker:
    """What one attacker knows across its identities: each one's honest delta of each round."""

    attack: Attack
    honest: dict[int, dict[str, Tensors]] = field(default_factory=dict)  # base version → worker id → Δ

    def noted(self, version: int, worker_id: str, delta: Tensors) -> None:
        self.honest.setdefault(version, {})[worker_id] = delta

    def forged(self, version: int) -> Tensors:
        """−(mean of the honest deltas its identities made on `version`): the same for each of them."""
        deltas = list(self.honest[version].values())
        return {n: -sum(d[n] for d in deltas) / len(deltas) for n in deltas[0]}


class ColludingWorker(BlockWorker):
    """One identity of an `Attacker`: makes its honest update (so its header and claims are an honest
    worker's), tells the attacker, and at push time, in a round the attack covers, pushes the attacker's
    forged delta instead (by then every identity of the attacker made its update of the round: they
    started it together and train as long)."""

    def __init__(self, *args: object, attacker: Attacker, **kwargs: object):
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.attacker = attacker

    def make_update(self) -> tuple[PushHeader, Raw]:
        header, raw = super().make_update()
        self.attacker.noted(header.base_version, self.wcfg.worker_id,
                            {n: decode(self.wcfg.codec, raw[n], self.spec[n]) for n in self.spec})
        return header, raw

    def push(self, header: PushHeader, raw: Raw) -> Judgement:
        if self.attacker.attack.turned(header.base_version):
            raw = encode_raw(self.attacker.forged(header.base_version), self.wcfg.codec)
        return super().push(header, raw)


class AccusingVerification(Verification):
    """Replays as asked, then attests another digest: it accuses every round it verifies."""

    def digest(self, task: VerifyTask, result: ReplayResult) -> str:
        return hashlib.sha256(b"accused" + result.digest.encode()).hexdigest()


class AccusingWorker(BlockWorker):
    """Trains and pushes honestly; as a verifier it accuses every honest round it is drawn to verify."""

    def make_verification(self) -> Verification:
        return AccusingVerification(self.cfg, self.wcfg.block, self.corpus, self.link, self.wcfg.worker_id)


@dataclass
class Ring:
    """Two identities of one attacker: what the forging one pushed (update id → its digest), so that the
    other, drawn as its verifier, can vouch for it without replaying."""

    pushed: dict[str, str] = field(default_factory=dict)
    vouched: int = 0  # times its verifier vouched for a forged update (the lie it is there to tell)


class RingForger(NegatedWorker):
    """Pushes −Δ (with honest claims) and tells its ring the digest it pushed."""

    def __init__(self, *args: object, ring: Ring, **kwargs: object):
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.ring = ring

    def make_update(self) -> tuple[PushHeader, Raw]:
        header, raw = super().make_update()
        assert header.claim is not None
        self.ring.pushed[header.update_id] = result_digest(raw, header.claim.optimizer_end, header.claim.residual_end)
        return header, raw


class VouchingVerification(Verification):
    def __init__(self, *args: object, ring: Ring, **kwargs: object):
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.ring = ring

    def digest(self, task: VerifyTask, result: ReplayResult) -> str:
        pushed = self.ring.pushed.get(task.task_id, result.digest)  # its partner's: the digest it pushed
        self.ring.vouched += pushed != result.digest  # a lie only where the partner forged
        return pushed


class VouchingWorker(BlockWorker):
    """Trains and pushes honestly, verifies others honestly, and vouches for its ring's forger."""

    def __init__(self, *args: object, ring: Ring, **kwargs: object):
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.ring = ring

    def make_verification(self) -> Verification:
        return VouchingVerification(self.cfg, self.wcfg.block, self.corpus, self.link, self.wcfg.worker_id,
                                    ring=self.ring)


VERIFIER_CHEATS = {"verifier_accusing": 1, "verifier_vouching": 2}  # name → identities it holds


def verifier_workers(name: str, ids: Sequence[str]) -> dict[str, Callable[..., BlockWorker]]:
    """One factory per identity of lying-verifier cheat `name` (len(ids) == VERIFIER_CHEATS[name])."""
    assert len(ids) == VERIFIER_CHEATS[name], f"{name} holds {VERIFIER_CHEATS[name]} identities, got {list(ids)}"
    if name == "verifier_accusing":
        return {ids[0]: AccusingWorker}
    ring = Ring()
    return {ids[0]: partial(VouchingWorker, ring=ring), ids[1]: partial(RingForger, ring=ring)}


def lied(worker: BlockWorker) -> bool:
    """Whether a cheating identity did cheat: a vouching verifier only once drawn for its forger."""
    return not isinstance(worker, VouchingWorker) or worker.ring.vouched > 0


def skip(worker: BlockWorker, n: int) -> None:
    """Lists n steps as trained without training them (the fold records each with the CE of the
    last step really trained, or 0)."""
    ce = worker._fold.pending[-1].ce if worker._fold.pending else 0.0
    for _ in range(n):
        worker._fold = worker._fold.trained(worker.trainer.step, ce)
        worker.trainer.step += 1


def other_data(corpus: ByteSource | bytes, how: str) -> bytes:
    """The cheater's own corpus: one sentence repeated, or the swarm's bytes reversed."""
    data = corpus if isinstance(corpus, bytes) else corpus.read(0, len(corpus))
    if how == "sentence":
        return SENTENCE * (len(data) // len(SENTENCE) + 1)
    return data[::-1]


def _on_other_data(how: str, cfg, tc, wcfg, link, corpus, **kwargs) -> BlockWorker:  # type: ignore[no-untyped-def]
    return BlockWorker(cfg, tc, wcfg, link, other_data(corpus, how), **kwargs)


CHEATS: dict[str, Callable[..., BlockWorker]] = {
    "zero": ZeroWorker,
    "negated": NegatedWorker,
    "scaled": ScaledWorker,
    "replay_own": ReplayOwnWorker,
    "data_sentence": partial(_on_other_data, "sentence"),
    "data_reversed": partial(_on_other_data, "reversed"),
    "lazy": LazyWorker,
    "free_rider": FreeRiderWorker,
    "replay_published": ReplayPublishedWorker,
    "copy": CopyingWorker,
    "sybil": SybilWorker,
}


ATTACKS: dict[str, Attack] = {
    "sybil3": Attack(ids=3),  # one attacker holding 3 of 5 identities, from its first round
    "sleeper2": Attack(ids=2, start=SLEEP),  # 2 of 5 collude after SLEEP honest rounds
    "sleeper_sybil3": Attack(ids=3, start=SLEEP),  # one attacker with 3 ids, after SLEEP honest rounds
    "flip_once_sybil3": Attack(ids=3, start=SLEEP, stop=SLEEP + 1),  # the 3 ids flip in one round only
}


def attack_workers(name: str, ids: Sequence[str]) -> dict[str, Callable[..., BlockWorker]]:
    """One factory per identity of attack `name` (len(ids) == its ATTACKS[name].ids), sharing one Attacker."""
    attack = ATTACKS[name]
    assert len(ids) == attack.ids, f"{name} holds {attack.ids} identities, got {list(ids)}"
    attacker = Attacker(attack)
    return {wid: partial(ColludingWorker, attacker=attacker) for wid in ids}


def cheat_factory(name: str, *, victim: Callable[[], BlockWorker] | None = None) -> Callable[..., BlockWorker]:
    """The factory of cheat `name`; "copy" needs `victim`, the worker whose updates it copies."""
    if name == "copy":
        assert victim is not None, "the copying cheat needs a victim"
        return partial(CopyingWorker, victim=victim)
    return CHEATS[name]
