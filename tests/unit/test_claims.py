"""What a push may claim (aggregate/trust/claims.py): real workers' updates always fit the derived weight
and the history-free bound; the issue's cheats are refused with `claim` or `bound` from round 0."""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch

from btnode.aggregate.round.config import AggregatorConfig
from btnode.aggregate.trust.claims import ClaimConfig, theta_ranges
from btnode.aggregate.round.rounds import RoundConfig
from btnode.aggregate.service import SwarmAggregator
from btnode.codec.codecs import Codec
from btnode.codec.frames import encode_frames, iter_chunks
from btnode.errors import MalformedInput
from btnode.model.config import ModelConfig
from btnode.protocol import Judgement, Outcome, PushHeader
from btnode.sim.link import LocalLink
from btnode.swarm.worker import BlockWorker, WorkerConfig
from btnode.train.config import TrainConfig
from btnode.train.terms import TrainingTerms

CFG = ModelConfig(d_model=32, n_heads=2, n_layers=1, n_blocks=1, context=32, segments=(1, 8))
TC = TrainConfig(steps=40, batch=4, warmup=2, lr=5e-3)
CORPUS = bytes(range(256)) * 40
H = 4
CLAIMS = ClaimConfig.of(TC, H)
PUSH = PushHeader(worker_id="w", block=0, base_version=0, samples=float(H * TC.batch), loss=0.0, codec=Codec.INT8,
                  update_id="u", steps=tuple(range(H)))


def swarm(tmp_path, codec, n=3):
    agg = SwarmAggregator(CFG, AggregatorConfig(round=RoundConfig(deadline_s=30.0), claims=CLAIMS), tmp_path)
    block = agg.block(0)
    ratios: list[float] = []
    submit = block.submit

    def measured(header, delta, **kw):  # every update that reaches the judge, before it is judged
        limits = CLAIMS.bound(len(header.steps), block.params, header.codec, drift=2)
        ratios.append(max(float((d.abs() / limits[k]).max()) for k, d in delta.items()))
        return submit(header, delta, **kw)

    block.submit = measured
    link = LocalLink(agg)
    workers = [BlockWorker(CFG, TC, WorkerConfig(worker_id=f"w{i}", block=0, steps_per_round=H, codec=codec,
                                                 rounds=4), link, CORPUS, device=torch.device("cpu"))
               for i in range(n)]
    return agg, workers, ratios


def run_all(workers) -> None:
    """Each worker's 4 rounds on a thread of its own; every update accepted."""
    threads = [threading.Thread(target=w.run) for w in workers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert all(w.stats.outcomes == {"pending": 4} for w in workers), [w.stats.outcomes for w in workers]


@pytest.mark.parametrize("codec", [Codec.INT8, Codec.FP32])
def test_honest_workers_that_fold_wait_steps_are_always_within_the_claims(tmp_path, codec):
    agg, workers, ratios = swarm(tmp_path, codec)
    run_all(workers)
    assert sum(w.stats.folds for w in workers) > 0  # wait steps were folded into later updates
    assert agg.block(0).counters[("rejected", "claim")] == agg.block(0).counters[("rejected", "bound")] == 0
    assert len(ratios) == 12 and max(ratios) < 1
    print(f"{codec.name}: max |Δ|/bound over {len(ratios)} honest updates = {max(ratios):.3f}")


def test_a_block_takes_thetas_ranges_once_a_version(tmp_path, monkeypatch):
    """The claims check takes θ's per-tensor ranges from its block, once per version (issue #25: each push
    read θ twice for them): 3 workers × 4 rounds take them 4 times, each of the θ then current."""
    taken = []

    def counted(theta):
        taken.append(theta_ranges(theta))
        return taken[-1]

    monkeypatch.setattr("btnode.aggregate.round.block.theta_ranges", counted)
    agg, workers, _ = swarm(tmp_path, Codec.INT8)
    run_all(workers)
    assert len(taken) == 4 and all(a != b for a, b in zip(taken, taken[1:]))  # θ moved every version
    block = agg.block(0)
    assert block._theta_ranges() == theta_ranges(block.params) and len(taken) == 5  # the new version's, taken anew


def one_worker(tmp_path, codec=Codec.INT8):
    agg, (w,), ratios = swarm(tmp_path, codec, n=1)
    w.start()
    w.train_steps(H)
    return agg, w, ratios


def test_a_refused_update_folded_into_the_next_holds_2h_steps_within_the_bound(tmp_path):
    agg, w, ratios = one_worker(tmp_path)
    header, _ = w.make_update()
    w.pushed(Judgement(Outcome.LATE, "round closed", 1))  # as if it arrived after the deadline
    w.train_steps(H)  # a full round of wait steps
    w.advance(agg.block(0).current()[0])
    assert w.steps_due() == 0
    header2, raw = w.make_update()
    assert len(header2.steps) == 2 * H == CLAIMS.max_steps
    assert w.push(header2, raw).outcome is Outcome.PENDING and max(ratios) < 1


def encode_chunks(delta, codec):
    return iter_chunks(encode_frames(delta, codec))


def honest(w):
    """A worker's honest update after H steps, decoded: what the cheats start from."""
    header, _ = w.make_update()
    delta = {n: w.trainer.model.state_dict()[n].detach() - w.base[n] for n in w.spec}
    return header, delta


CHEATS = {
    "x10": lambda h, d: (h, {n: 10 * t for n, t in d.items()}),
    "zero claiming 1e9 samples": lambda h, d: (dataclasses.replace(h, samples=1e9),
                                               {n: torch.zeros_like(t) for n, t in d.items()}),
    "negated claiming 1e9 samples": lambda h, d: (dataclasses.replace(h, samples=1e9), {n: -t for n, t in d.items()}),
    "5 steps claiming 25": lambda h, d: (dataclasses.replace(h, steps=tuple(range(5)), samples=25.0 * TC.batch), d),
    "samples not steps × batch": lambda h, d: (dataclasses.replace(h, samples=h.samples + 1), d),
    "duplicate steps": lambda h, d: (dataclasses.replace(h, steps=(0, 0, 1, 2)), d),
    "steps out of order": lambda h, d: (dataclasses.replace(h, steps=(0, 2, 1, 3)), d),
    "more than 2H steps": lambda h, d: (dataclasses.replace(h, steps=tuple(range(2 * H + 1)),
                                                            samples=float((2 * H + 1) * TC.batch)), d),
    "no steps": lambda h, d: (dataclasses.replace(h, steps=()), d),
}
EXPECTED = {"x10": "bound"}


@pytest.mark.parametrize("cheat", CHEATS)
def test_the_issues_cheats_are_refused_from_round_0(tmp_path, cheat):
    agg, w, _ = one_worker(tmp_path, Codec.FP32)
    header, delta = CHEATS[cheat](*honest(w))
    with pytest.raises(MalformedInput) as err:
        agg.push(header, encode_chunks(delta, Codec.FP32))
    reason = EXPECTED.get(cheat, "claim")
    assert err.value.reason == reason
    assert agg.block(0).counters[("rejected", reason)] == 1 and agg.block(0).info.version == 0


@pytest.mark.parametrize("at_once", [None, 7], ids=["whole", "sliced"])
@pytest.mark.parametrize("codec", [Codec.FP32, Codec.INT8])
def test_check_agrees_with_bound_at_and_one_ulp_over_every_coordinate_limit(codec, at_once, monkeypatch):
    """check() decides a tensor within its least bound at once and builds the rest in place: either way
    its answer is bound()'s, coordinate for coordinate; also built CHECK_AT_ONCE values at a time (issue
    #25: two buffers of a slice, not of the largest tensor), here 7, across slice edges."""
    if at_once is not None:
        monkeypatch.setattr("btnode.aggregate.trust.claims.CHECK_AT_ONCE", at_once)
    theta = {"w": torch.linspace(-3, 3, 600).reshape(20, 30), "b": torch.randn(7), "v": torch.randn(5, 4) * 1e-3}
    header = dataclasses.replace(PUSH, codec=codec)
    limits = CLAIMS.bound(len(header.steps), theta, codec)
    at = {n: -limits[n] for n in theta}  # every coordinate exactly at its bound, |θ| large and small alike
    assert CLAIMS.check(header, at, theta) == len(header.steps) * TC.batch
    for i in (0, 299, 599):  # the largest |θ|, the smallest, the other end
        over = {n: t.clone() for n, t in at.items()}
        over["w"].view(-1)[i] = -torch.nextafter(limits["w"].view(-1)[i], torch.tensor(float("inf")))
        with pytest.raises(MalformedInput, match=rf"w\[{i}\] moved") as err:
            CLAIMS.check(header, over, theta)
        assert err.value.reason == "bound"


def test_many_joins_at_once_each_get_in_and_their_terms_are_kept(tmp_path):
    """Joins arrive on many RPC threads at once (bench/scale.py, issue #25): none fails, and the state
    folder keeps every worker's training terms. Threads switch every microsecond here, so that one
    join's write of the terms overlaps another's change of them, as it did at N = 256."""
    import sys

    agg = SwarmAggregator(CFG, AggregatorConfig(claims=CLAIMS), tmp_path)
    terms = TrainingTerms(TC, H).to_json()
    n, each = 32, 8
    start, errors = threading.Barrier(n), []

    def join(i: int) -> None:
        start.wait()
        try:
            for k in range(each):
                agg.join(f"w{i}-{k}", 0, CFG.fingerprint(), "{}", training_json=terms)
        except BaseException as exc:  # noqa: BLE001 - collected and asserted below
            errors.append(exc)

    threads = [threading.Thread(target=join, args=(i,)) for i in range(n)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert errors == []
    again = SwarmAggregator(CFG, AggregatorConfig(claims=CLAIMS), tmp_path)
    assert all(again.training(f"w{i}-{k}") is not None for i in range(n) for k in range(each))


def test_workers_with_the_same_terms_share_one_copy_of_them(tmp_path):
    """The root keeps one TrainingTerms and one JSON text per distinct terms, not per worker (issue #25:
    ~0.9 KB a worker, bench/join_memory.py), before and after a restart; other terms stay their own."""
    agg = SwarmAggregator(CFG, AggregatorConfig(claims=CLAIMS), tmp_path)
    same, longer = TrainingTerms(TC, H), TrainingTerms(dataclasses.replace(TC, steps=TC.steps * 2), H)
    for w, terms in (("a", same), ("b", same), ("c", longer)):
        agg.join(w, 0, CFG.fingerprint(), "{}", training_json=terms.to_json())
    for a in (agg, SwarmAggregator(CFG, AggregatorConfig(claims=CLAIMS), tmp_path)):
        assert a.training("a") == same and a.training("c") == longer
        assert a.training("a") is a.training("b") and a.training("c") is not a.training("a")
        texts = a._terms_journal.values
        assert texts["a"] is texts["b"] and texts["c"] == longer.to_json()
