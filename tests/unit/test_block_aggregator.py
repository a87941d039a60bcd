"""BlockAggregator in process with a fake clock: exact versions, outcomes, durability, resume."""

import pytest
import torch

from btnode.aggregate.sums.averaging import OuterConfig
from btnode.aggregate.round.block import BlockAggregator
from btnode.aggregate.round.config import AggregatorConfig
from btnode.aggregate.trust.claims import ClaimConfig
from btnode.aggregate.round.rounds import RoundConfig
from btnode.codec.codecs import Codec, decode
from btnode.errors import MalformedInput, StaleUpdate
from btnode.protocol import Outcome, PushHeader
from btnode.store.files import state_sha256
from btnode.store.versions import VersionStore

INIT = {"a": torch.randn(4, 3), "b": torch.randn(7)}
# batch 1 and an inner lr of 1: a push of s steps claims s samples and may move a coordinate about 1.165·s
CLAIMS = ClaimConfig(batch=1, lr=1.0, steps_per_round=4, enforce=True)


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def make(tmp_path, clock=None, **kw):
    acfg = AggregatorConfig(round=kw.pop("round", RoundConfig(deadline_s=10.0)), claims=CLAIMS, **kw)
    return BlockAggregator(0, INIT, VersionStore(tmp_path, 0, keep=acfg.keep), acfg, clock=clock or Clock())


def header(worker, base, samples=1.0, uid=None):
    """An honest claim: `samples` steps of one window each."""
    return PushHeader(worker_id=worker, block=0, base_version=base, samples=samples, loss=1.0, codec=Codec.FP32,
                      update_id=uid or f"{worker}-{base}", steps=tuple(range(int(samples))))


def delta(scale):
    return {n: torch.full_like(t, scale) + 0.01 * torch.arange(t.numel()).view(t.shape) for n, t in INIT.items()}


def test_new_version_is_base_plus_eta_times_weighted_mean(tmp_path):
    clock = Clock()
    agg = make(tmp_path, clock, outer=OuterConfig(lr=0.7))
    for w in ("x", "y"):
        agg.register(w)
    d1, d2 = delta(1.0), delta(-3.0)
    assert agg.submit(header("y", 0, samples=3.0), d2).outcome is Outcome.PENDING
    assert agg.info.version == 0  # x has not reported yet
    assert agg.submit(header("x", 0, samples=1.0), d1).outcome is Outcome.PENDING
    info, params = agg.current()
    assert info.version == 1 and info.closed_by == "all_reported" and info.accepted == 2
    for n, t in INIT.items():  # sorted by worker id: x then y
        acc = torch.zeros_like(t)
        acc += (1.0 / 4.0) * d1[n]
        acc += (3.0 / 4.0) * d2[n]
        # the sum is exact fixed point (aggregate/sums/accumulate.py): within 2^-38 of a weight unit per term
        torch.testing.assert_close(params[n], t + 0.7 * acc, rtol=0, atol=1e-6)
    assert info.sha256 == state_sha256(params)


def test_published_version_is_on_disk_before_it_is_announced(tmp_path):
    agg = make(tmp_path)
    agg.register("x")
    agg.submit(header("x", 0), delta(0.5))
    info = agg.wait_for(0, timeout=1.0)
    stored = VersionStore(tmp_path, 0).load(info.version)
    assert state_sha256(stored.params) == info.sha256
    codec, raw, _ = VersionStore(tmp_path, 0).delta(info.version)
    assert codec is Codec.FP32 and all(torch.equal(INIT[n] + decode(codec, raw[n], INIT[n].shape), stored.params[n])
                                       for n in INIT)


def test_deadline_closes_with_a_silent_replica_and_late_updates_are_not_applied(tmp_path):
    clock = Clock()
    agg = make(tmp_path, clock)
    agg.register("x")
    agg.register("slow")
    agg.submit(header("x", 0), delta(1.0))
    assert agg.tick() is None  # before the deadline, waiting for "slow"
    clock.t += 10.0
    info = agg.tick()
    assert info is not None and info.version == 1 and info.closed_by == "deadline"
    before = {n: t.clone() for n, t in agg.params.items()}
    j = agg.submit(header("slow", 0, samples=5.0), delta(5.0))
    assert j.outcome is Outcome.LATE and "closed before" in j.reason
    assert all(torch.equal(before[n], agg.params[n]) for n in before)
    agg.submit(header("x", 1), delta(1.0))
    clock.t += 10.0
    assert agg.tick().version == 2
    with pytest.raises(StaleUpdate):
        agg.submit(header("slow", 0, uid="old"), delta(1.0))
    assert agg.counters[("stale", "stale")] == 1 and agg.counters[("late", "")] == 1


def test_repush_with_the_same_update_id_gets_the_same_answer_and_counts_once(tmp_path):
    agg = make(tmp_path)
    agg.register("x")
    agg.register("y")
    h = header("x", 0, uid="same")
    assert agg.submit(h, delta(1.0)).outcome is Outcome.PENDING
    assert agg.submit(h, delta(1.0)).outcome is Outcome.PENDING
    assert len(agg.round.accepted) == 1 and agg.counters[("pending", "")] == 1


def test_an_update_far_beyond_the_accepted_norms_is_rejected(tmp_path):
    clock = Clock()
    agg = make(tmp_path, clock)
    for v in range(3):
        for w in ("a", "b"):
            agg.register(w)
            agg.submit(header(w, v), delta(0.1 if w == "a" else 0.2))
    assert agg.info.version == 3
    with pytest.raises(MalformedInput, match="over 10× the median"):
        agg.submit(header("a", 3, samples=8.0), delta(5.0))  # within the bound of 8 steps
    assert agg.counters[("rejected", "norm")] == 1 and agg.info.version == 3


def test_restart_resumes_same_version_hash_and_keeps_k(tmp_path):
    clock = Clock()
    agg = make(tmp_path, clock, keep=2, outer=OuterConfig(lr=0.7, momentum=0.9), publish_codec=Codec.INT8)
    agg.register("x")
    for v in range(4):
        agg.submit(header("x", v), delta(0.01 * (v + 1)))
    assert agg.info.version == 4
    assert VersionStore(tmp_path, 0).versions() == [3, 4]
    again = make(tmp_path, clock, keep=2, outer=OuterConfig(lr=0.7, momentum=0.9), publish_codec=Codec.INT8)
    assert again.info == agg.info and all(torch.equal(again.params[n], agg.params[n]) for n in INIT)
    assert all(torch.equal(again.outer.buffers[n], agg.outer.buffers[n]) for n in INIT)
    assert all(torch.equal(again.residual[n], agg.residual[n]) for n in INIT)
    # both continue identically
    for a in (agg, again):
        a.register("x")
        a.submit(header("x", 4, uid="next"), delta(0.02))
    assert again.info.sha256 == agg.info.sha256


def test_torn_newest_version_is_skipped_on_restart(tmp_path):
    agg = make(tmp_path)
    agg.register("x")
    agg.submit(header("x", 0), delta(0.1))
    agg.submit(header("x", 1), delta(0.1))
    newest = tmp_path / "block-0" / "v000000000002.safetensors"
    newest.write_bytes(newest.read_bytes()[:50])  # a crash mid-write of the tensors
    again = make(tmp_path)
    assert again.info.version == 1


def test_lossy_publish_codec_keeps_replicas_exact(tmp_path):
    agg = make(tmp_path, publish_codec=Codec.INT8)
    agg.register("x")
    agg.submit(header("x", 0), delta(0.3))
    codec, raw, _ = agg.store.delta(1)
    replica = {n: INIT[n] + decode(codec, raw[n], INIT[n].shape) for n in INIT}
    assert state_sha256(replica) == agg.info.sha256
    assert any(float(r.abs().max()) > 0 for r in agg.residual.values())  # the rounding error is carried


def test_the_first_round_starts_its_clock_when_the_first_replica_registers(tmp_path):
    clock = Clock()
    agg = make(tmp_path, clock)
    clock.t += 100.0  # the swarm takes a while to start
    agg.register("x")
    agg.register("y")
    agg.submit(header("x", 0), delta(0.1))
    assert agg.tick() is None  # τ counts from the first registration, not from start-up
    clock.t += 10.0
    assert agg.tick().closed_by == "deadline"


def test_a_round_with_nothing_accepted_restarts_its_clock_at_the_deadline(tmp_path):
    """Replicas that were all away come back together: both get a full τ, not just the first."""
    clock = Clock()
    agg = make(tmp_path, clock, round=RoundConfig(deadline_s=10.0))
    for w in ("x", "y", "z"):
        agg.register(w)
    clock.t += 15.0  # the deadline passed and nobody pushed
    assert agg.tick() is None and agg.round.deadline() == clock.t + 10.0
    clock.t += 3.0
    assert agg.submit(header("x", 0), delta(1.0)).outcome is Outcome.PENDING
    assert agg.info.version == 0  # before the restart this first arrival would have closed the round alone
    clock.t += 3.0
    assert agg.submit(header("y", 0, samples=2.0), delta(2.0)).outcome is Outcome.PENDING
    clock.t += 5.0
    info = agg.tick()
    assert info is not None and info.accepted == 2 and info.closed_by == "deadline"


@pytest.mark.parametrize("robust", ["screened", "mean"])
def test_the_default_screen_drops_zero_sign_flipped_and_off_course_updates_at_close(tmp_path, robust):
    agg = make(tmp_path, outer=OuterConfig(robust=robust))
    # a, b, c and g agree as honest updates do (cosines near 0.95), not exactly: exactly parallel updates
    # would be near-copies sharing one vote (round/screen.py `votes`), and four of seven hold the median
    gen = torch.Generator().manual_seed(1)
    sent = {w: {n: t + 0.15 * torch.randn(t.shape, generator=gen) for n, t in delta(s).items()}
            for w, s in (("a", 0.5), ("b", 0.6), ("c", 0.55), ("g", 0.5))}
    sent["e"] = delta(-0.55)
    sent["d"] = {n: torch.zeros_like(t) for n, t in INIT.items()}
    # signs alternating: a low cosine with the round's median update, far under that of a, b, c and g
    sent["f"] = {n: 0.55 * torch.tensor([1.0, -1.0] * 6)[:t.numel()].view(t.shape) for n, t in INIT.items()}
    for w in sent:
        agg.register(w)
    for w, d in sent.items():
        assert agg.submit(header(w, 0), d).outcome is Outcome.PENDING  # the round cannot judge them alone
    info, params = agg.current()
    kept = ["a", "b", "c", "g"] if robust == "screened" else sorted(sent)
    assert info.version == 1 and info.accepted == len(kept) and info.rejected == len(sent) - len(kept)
    for n, t in INIT.items():  # the weighted mean of what was kept, in worker-id order
        acc = torch.zeros_like(t)
        for w in kept:
            acc += (1.0 / len(kept)) * sent[w][n]
        torch.testing.assert_close(params[n], t + acc, rtol=0, atol=1e-6)
    if robust == "screened":
        assert agg.recent[-1].dropped == (("d", "norm_at_close"), ("e", "direction_at_close"),
                                          ("f", "direction_at_close"))
        assert agg.counters[("dropped", "norm_at_close")] == 1 and agg.counters[("dropped", "direction_at_close")] == 2
        assert agg.counters[("pending", "")] == 7 and agg.counters[("applied", "")] == 4
    else:
        assert agg.recent[-1].dropped == ()
