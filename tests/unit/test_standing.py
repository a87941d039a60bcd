"""The screen's reference (a weighted median of the sketches), near-copies as one vote, and standing:
an identity's weight from its verified work and its drops at close (aggregate/trust/standing.py)."""

import pytest
import torch

from btnode.aggregate.round.block import BlockAggregator
from btnode.aggregate.round.config import AggregatorConfig
from btnode.aggregate.round.rounds import RoundConfig, Update
from btnode.aggregate.round.screen import near_copies, screen, sketch_cosines, votes, weighted_median
from btnode.aggregate.trust.audit import AuditConfig, Audits, Verdict
from btnode.aggregate.trust.claims import ClaimConfig
from btnode.aggregate.trust.standing import UNWEIGHTED, Standing, StandingConfig
from btnode.codec.codecs import Codec
from btnode.errors import ConfigError
from btnode.protocol import Outcome, PushHeader
from btnode.store.versions import VersionStore

INIT = {"a": torch.zeros(16, 8), "b": torch.zeros(64)}
CLAIMS = ClaimConfig(batch=1, lr=1.0, steps_per_round=4, enforce=True)
HONEST, ATTACKERS = ("h1", "h2"), ("x1", "x2", "x3")


def header(worker, base=0, samples=2.0):
    return PushHeader(worker_id=worker, block=0, base_version=base, samples=samples, loss=1.0, codec=Codec.FP32,
                      update_id=f"{worker}-{base}", steps=tuple(range(int(samples))))


def honest_pair(seed=0):
    """Two honest updates: a shared direction plus each its own noise (cosine near 0.8, as honest replicas')."""
    g = torch.Generator().manual_seed(seed)
    common = {n: 0.3 * torch.randn(t.shape, generator=g) for n, t in INIT.items()}
    return [{n: c + 0.15 * torch.randn(c.shape, generator=g) for n, c in common.items()} for _ in range(2)]


def against(honest):
    """The issue's Sybil: −(mean of the honest updates), pushed identically under every attacker id."""
    return {n: -(honest[0][n] + honest[1][n]) / 2 for n in INIT}


def audits(probation=2):
    return Audits(AuditConfig(share=0.25, probation=probation), b"secret", lambda: 0.0)


def passes(book, worker, n):
    for i in range(n):
        book.record(Verdict(header(worker, i), True, "", "", 0.0, False, 0.0))


def make(tmp_path, standing=None, **kw):
    acfg = AggregatorConfig(round=RoundConfig(deadline_s=10.0), claims=CLAIMS, **kw)
    return BlockAggregator(0, INIT, VersionStore(tmp_path, 0, keep=acfg.keep), acfg, clock=lambda: 1000.0,
                           standing=standing)


def sybil_round(agg, honest, bad):
    for w in (*HONEST, *ATTACKERS):
        agg.register(w)
    for w, d in zip(HONEST, honest):
        assert agg.submit(header(w), d).outcome is Outcome.PENDING
    for w in ATTACKERS:
        assert agg.submit(header(w), bad).outcome is Outcome.PENDING
    assert agg.info.version == 1
    return agg.current()[1]


def assert_honest_mean(params, honest):
    for n in INIT:  # the round's sum is exact fixed point: the honest mean to within its grid
        torch.testing.assert_close(params[n], (honest[0][n] + honest[1][n]) / 2, rtol=0, atol=1e-6)


# -- the reference ------------------------------------------------------------------------------
def test_the_weighted_median_is_the_median_under_equal_weights_and_leaves_out_weight_zero():
    g = torch.Generator().manual_seed(3)
    for n in (3, 4, 5, 8):
        rows = torch.randn(n, 700, generator=g, dtype=torch.float64)
        ones = torch.ones(n, dtype=torch.float64)
        lo, hi = rows.sort(0).values[(n - 1) // 2], rows.sort(0).values[n // 2]
        torch.testing.assert_close(weighted_median(rows, ones), (lo + hi) / 2, rtol=0, atol=0)
    rows = torch.tensor([[1.0], [2.0], [3.0], [100.0], [200.0]], dtype=torch.float64)
    assert float(weighted_median(rows, torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0]))) == 2.0  # the zeros do not vote
    assert float(weighted_median(rows, torch.tensor([0.2, 0.2, 0.2, 1.0, 0.0]))) == 100.0  # weight, not count
    assert float(weighted_median(rows, torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0]))) == 50.5  # exactly half: the mean


def test_identical_updates_share_one_vote_and_an_uncopied_update_keeps_its_weight():
    g = torch.Generator().manual_seed(0)
    s = torch.randn(3, 4096, generator=g, dtype=torch.float64)
    ups = [Update(worker_id=w, update_id=w, base_version=0, samples=1.0, loss=0.0, delta=None, weight=1.0, sketch=k)
           for w, k in zip("abcdef", [s[0], s[0], 1.01 * s[0] + 0.01 * s[1], s[1], s[2], s[2]])]
    near = near_copies(ups, 0.99)
    assert [sorted(x.tolist()) for x in near] == [[0, 1, 2]] * 3 + [[3], [4, 5], [4, 5]]
    assert votes([1.0] * 6, near) == pytest.approx([1 / 3] * 3 + [1.0, 0.5, 0.5])
    # a copy made by an identity of weight 0 takes nothing from the original, and weighs nothing
    assert votes([1.0, 0.0, 0.0, 1.0, 1.0, 0.0], near) == pytest.approx([1.0, 0.0, 0.0, 1.0, 1.0, 0.0])
    # copies of unequal weight weigh at most their heaviest together
    assert sum(votes([1.0, 0.25, 0.25, 1.0, 1.0, 1.0], near)[:3]) == pytest.approx(1.5 ** -1 * (1 + 2 * 0.0625))


@pytest.mark.parametrize("copies", [3, 2])
def test_three_or_two_identical_attackers_do_not_set_the_reference_and_honest_updates_are_kept(copies):
    """The issue's probe: 3 identical −mean updates of 5 were the median (cosine 1.000) and both honest ones
    were dropped; with an even count an identical pair supplied one of the two middle values."""
    g = torch.Generator().manual_seed(1)
    common = torch.randn(4096, generator=g, dtype=torch.float64)
    honest = [common + 0.7 * torch.randn(4096, generator=g, dtype=torch.float64) for _ in range(2)]
    bad = -(honest[0] + honest[1]) / 2
    ids = ["h1", "h2", *(f"x{i}" for i in range(copies))]
    ups = [Update(worker_id=w, update_id=w, base_version=0, samples=2.0, loss=0.0, delta=None, weight=2.0,
                  norm=float(k.norm()), sketch=k) for w, k in zip(ids, [*honest, *[bad] * copies])]
    out = screen(ups, AggregatorConfig(), "test")
    assert [u.worker_id for u in out.kept] == ["h1", "h2"]
    assert sorted((u.worker_id, why) for u, why in out.dropped) == [(f"x{i}", "direction_at_close") for i in range(copies)]
    assert out.weights == {"h1": 2.0, "h2": 2.0}


def test_in_a_block_three_identical_attackers_are_dropped_and_the_version_is_the_honest_mean(tmp_path):
    honest = honest_pair()
    agg = make(tmp_path)
    assert_honest_mean(sybil_round(agg, honest, against(honest)), honest)
    assert agg.recent[-1].dropped == tuple((w, "direction_at_close") for w in ATTACKERS)


# -- standing -----------------------------------------------------------------------------------
def test_standing_is_zero_on_probation_then_grows_with_audits_passed_up_to_one():
    book = audits(probation=2)
    st = Standing(StandingConfig(full_at=8), book, probation=2)
    assert st.factor("new") == 0.0
    passes(book, "new", 1)
    assert st.factor("new") == 0.0
    passes(book, "new", 1)
    assert st.factor("new") == 2 / 8
    passes(book, "new", 10)
    assert st.factor("new") == 1.0
    assert Standing(StandingConfig(), None).factor("anyone") == 1.0  # no audits: nothing verified, nobody ranked


def test_repeated_drops_halve_the_weight_then_send_the_identity_back_to_probation():
    book = audits(probation=2)
    st = Standing(StandingConfig(full_at=4, drop_window=8, drop_limit=2), book, probation=2)
    passes(book, "w", 6)
    assert st.factor("w") == 1.0 and not book.on_probation("w")
    assert st.closed(["w"], []) == [] and st.factor("w") == 1.0
    assert st.closed([], [("w", "direction_at_close")]) == [] and st.factor("w") == 0.5
    assert st.closed([], [("w", UNWEIGHTED)]) == [] and st.factor("w") == 0.5  # weighing nothing is no drop
    assert st.closed([], [("w", "norm_at_close")]) == ["w"]
    assert book.on_probation("w") and st.factor("w") == 0.0  # every update audited and held until it passes
    passes(book, "w", 2)
    assert not book.on_probation("w") and st.factor("w") == 1.0  # its verified work stands
    without = Standing(StandingConfig(drop_limit=2), None)
    without.closed([], [("v", "direction_at_close"), ("v", "direction_at_close")])
    assert without.factor("v") == 0.25  # no audits to send it to: its weight alone falls


def test_a_block_sends_an_identity_dropped_twice_back_to_probation(tmp_path):
    book = audits(probation=1)
    for w in (*HONEST, "x1"):
        passes(book, w, 8)
    agg = make(tmp_path, Standing(StandingConfig(full_at=8, drop_limit=2), book, probation=1))
    for v in range(2):
        honest = honest_pair(seed=v)
        for w in (*HONEST, "x1"):
            agg.register(w)
        for w, d in zip(HONEST, honest):
            agg.submit(header(w, v), d)
        agg.submit(header("x1", v), {n: -t for n, t in honest[0].items()})
        assert agg.info.version == v + 1 and agg.recent[-1].dropped == (("x1", "direction_at_close"),)
        assert book.on_probation("x1") is (v == 1)
    assert not book.on_probation("h1") and not book.on_probation("h2")


def test_open_mode_fresh_identical_attackers_weigh_nothing_and_honest_updates_are_kept(tmp_path):
    """2 established honest identities and 3 fresh ones pushing one update: the fresh weigh 0, in the
    reference and in the mean, whether or not the screen would have dropped them."""
    book = audits(probation=2)
    for w in HONEST:
        passes(book, w, 8)
    cfg = dict(open=True, audit=AuditConfig(share=0.25, probation=2))
    for bad in (against, lambda h: h[0]):  # opposed to the honest mean, or a copy of an honest update
        honest = honest_pair()
        agg = make(tmp_path / bad.__name__, Standing(StandingConfig(), book, probation=2), **cfg)
        params = sybil_round(agg, honest, bad(honest))
        assert_honest_mean(params, honest)
        assert {w for w, _ in agg.recent[-1].dropped} == set(ATTACKERS)
        assert agg.current()[0].accepted == 2 and set(agg.current()[0].included) == {"h1-0", "h2-0"}
    assert {why for _, why in agg.recent[-1].dropped} == {UNWEIGHTED}  # a copy is not off course: it weighs nothing


def test_when_nobody_in_a_round_has_standing_each_weighs_its_work(tmp_path):
    agg = make(tmp_path, Standing(StandingConfig(), audits(), probation=2))
    honest = honest_pair()
    for w in HONEST:
        agg.register(w)
    for w, d in zip(HONEST, honest):
        agg.submit(header(w), d)
    assert agg.info.version == 1 and agg.recent[-1].dropped == ()
    assert_honest_mean(agg.current()[1], honest)


def test_open_mode_needs_audits_with_probation():
    with pytest.raises(ConfigError, match="--open"):
        AggregatorConfig(open=True, audit=AuditConfig(share=0.0))
    assert AggregatorConfig(open=True).open  # audits are on by default
    with pytest.raises(ConfigError, match="--open"):
        AggregatorConfig(open=True, audit=AuditConfig(share=0.25, probation=0))
    assert AggregatorConfig(open=True, audit=AuditConfig(share=0.25)).open


def test_a_sparse_update_is_judged_on_the_coordinates_it_sent():
    """An honest sparse update that sent a subset of the coordinates the others sent, and agrees with them
    there, has the cosine of its agreement: on all coordinates its cosine was also cut by the share of the
    others' energy it did not send (0.46 here, against the others' 0.6). A sign-flipped update is still dropped, and so is one that
    puts most of its mass where nobody else sent anything (its own coordinates still count in its norm)."""
    g = torch.Generator().manual_seed(2)
    common = torch.randn(4096, generator=g, dtype=torch.float64)
    shared, own = torch.arange(0, 600), torch.arange(600, 4096)

    def sent(n_shared: int, n_own: int, i: int, sign: float = 1.0) -> torch.Tensor:  # sign: scale, and its sign
        where = torch.cat([shared[:n_shared], own[i * 500:i * 500 + n_own]])
        s = torch.zeros(4096, dtype=torch.float64)
        s[where] = sign * (common[where] + 0.3 * torch.randn(len(where), generator=g, dtype=torch.float64))
        return s

    sketches = [sent(600, 100, 0), sent(600, 100, 1), sent(600, 100, 2), sent(150, 0, 3, 1.5), sent(600, 100, 4, -1.0),
                sent(100, 500, 5)]
    ups = [Update(worker_id=w, update_id=w, base_version=0, samples=2.0, loss=0.0, delta=None, weight=2.0,
                  norm=float(k.norm()), sketch=k, codec=Codec.SPARSE8) for w, k in zip("abcdxz", sketches)]
    cos = sketch_cosines(ups)
    assert cos[3] > 0.85 and cos[4] < 0 and cos[5] < 0.5, cos
    out = screen(ups, AggregatorConfig(), "test")
    assert [u.worker_id for u in out.kept] == ["a", "b", "c", "d"]
    assert [(u.worker_id, why) for u, why in out.dropped] == [("x", "direction_at_close"), ("z", "direction_at_close")]
