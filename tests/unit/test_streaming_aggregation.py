"""Issue #25, item 1: updates are summed as they arrive and not held. The running sum is exact
(fixed point), so a version is the same bit for bit in any arrival order, and an update taken out
(the screen, a failed audit) subtracts exactly what it added, re-read from the round's spill."""

import random

import pytest
import torch

from btnode.aggregate.sums.accumulate import MAX_TERM, Accumulator, Sketcher, weight_unit
from btnode.aggregate.sums.averaging import OuterConfig, weighted_mean
from btnode.aggregate.round.block import BlockAggregator
from btnode.aggregate.round.config import AggregatorConfig
from btnode.aggregate.trust.claims import ClaimConfig
from btnode.aggregate.round.rounds import RoundConfig
from btnode.codec.codecs import Codec, decode, encode
from btnode.codec.sparse import SparseTensor, keep_of
from btnode.errors import MalformedInput
from btnode.protocol import Outcome, PushHeader
from btnode.store.versions import VersionStore

INIT = {"w": torch.randn(64, 96, generator=torch.Generator().manual_seed(1)), "b": torch.zeros(5000)}
CLAIMS = ClaimConfig(batch=1, lr=1.0, steps_per_round=4, enforce=True)
WORKERS = [f"w{i:02d}" for i in range(12)]


def make(tmp_path, robust="screened", **kw) -> BlockAggregator:
    acfg = AggregatorConfig(round=RoundConfig(deadline_s=10.0), claims=CLAIMS, outer=OuterConfig(robust=robust), **kw)
    return BlockAggregator(0, INIT, VersionStore(tmp_path, 0, keep=acfg.keep), acfg, clock=lambda: 1000.0,
                           sketch_key=b"k" * 32)


def pushed(worker: str, codec: Codec, i: int, flip: bool = False) -> tuple[PushHeader, dict, dict]:
    """(header, decoded delta, raw codec bytes) of one honest update (or a sign-flipped one)."""
    g = torch.Generator().manual_seed(100 + i)
    common = torch.Generator().manual_seed(7)  # what every honest worker learns, plus its own noise
    raw, delta = {}, {}
    for n, t in INIT.items():
        d = 0.05 * torch.randn(t.shape, generator=common) + 0.02 * torch.randn(t.shape, generator=g)
        d = -d if flip else d
        raw[n] = encode(codec, d, keep=keep_of(0.05))
        delta[n] = (SparseTensor.decode(raw[n], tuple(t.shape), codec.two_bit) if codec.sparse
                    else decode(codec, raw[n], tuple(t.shape)))
    steps = 1 + i % 4
    head = PushHeader(worker_id=worker, block=0, base_version=0, samples=float(steps), loss=1.0, codec=codec,
                      update_id=f"{worker}-0", steps=tuple(range(steps)))
    return head, delta, raw


def round_of(tmp_path, order: list[str], codec: Codec, robust="screened", flipped=()) -> BlockAggregator:
    agg = make(tmp_path, robust=robust)
    for w in WORKERS:
        agg.register(w)
    for w in order:
        head, delta, raw = pushed(w, codec, WORKERS.index(w), flip=w in flipped)
        assert agg.submit(head, delta, raw=raw).outcome is Outcome.PENDING
    assert agg.info.version == 1
    return agg


@pytest.mark.parametrize("codec", [Codec.INT8, Codec.FP32, Codec.SPARSE8])
def test_shuffled_arrival_publishes_the_same_version_bit_for_bit(tmp_path, codec):
    orders = [list(WORKERS), list(reversed(WORKERS))]
    orders += [random.Random(s).sample(WORKERS, len(WORKERS)) for s in range(3)]
    infos, params = [], []
    for k, order in enumerate(orders):
        agg = round_of(tmp_path / str(k), order, codec, flipped=("w03",))
        infos.append(agg.info)
        params.append(agg.params)
        assert agg.recent[-1].dropped == (("w03", "direction_at_close"),)  # the same drop in every order
    assert len({i.sha256 for i in infos}) == 1
    assert all(torch.equal(p[n], params[0][n]) for p in params for n in INIT)


def test_the_round_holds_no_update_only_its_sketch_and_where_its_bytes_are(tmp_path):
    agg = make(tmp_path)
    for w in WORKERS:
        agg.register(w)
    for w in WORKERS[:5]:
        head, delta, raw = pushed(w, Codec.INT8, WORKERS.index(w))
        agg.submit(head, delta, raw=raw)
    held = list(agg.round.accepted.values())
    assert len(held) == 5 and all(u.delta is None and u.raw is None and u.spilled for u in held)
    assert all(u.sketch.numel() == 4096 for u in held)
    assert agg._spill.size == 5 * sum(len(b) for b in raw.values())  # one int8 copy each, on disk, not in RAM


def test_a_drop_subtracts_exactly_what_the_update_added(tmp_path):
    """Five updates, then a sixth taken out by an audit: the sum is the five's to the last bit."""
    five = after_drop = None
    for with_sixth in (False, True):
        agg = make(tmp_path / str(with_sixth), robust="mean")
        for w in WORKERS:
            agg.register(w)
        for w in WORKERS[:5] + (["w09"] if with_sixth else []):
            head, delta, raw = pushed(w, Codec.INT8, WORKERS.index(w))
            agg.submit(head, delta, raw=raw)
        if with_sixth:
            assert agg.drop("w09", "audit_replay")
            after_drop = {n: t.clone() for n, t in agg._sum.sum.items()}
            assert agg._sum.count == 5
        else:
            five = {n: t.clone() for n, t in agg._sum.sum.items()}
    assert all(torch.equal(five[n], after_drop[n]) for n in INIT)


def test_the_mean_is_the_weighted_mean_to_within_the_grid():
    spec = {n: tuple(t.shape) for n, t in INIT.items()}
    deltas = [{n: torch.randn(t.shape) * 0.1 for n, t in INIT.items()} for _ in range(7)]
    weights = [1.0, 2.0, 4.0, 0.5, 3.0, 8.0, 6.0]
    acc = Accumulator(spec, "all", unit=weight_unit(8.0))
    for d, w in zip(deltas, weights):
        acc.add(d, w)
    want = weighted_mean(deltas, weights)
    for n in INIT:
        torch.testing.assert_close(acc.mean_of(n), want[n], rtol=0, atol=1e-7)


@pytest.mark.parametrize("rule", ["all", "senders"])
def test_terms_made_a_slice_at_a_time_sum_to_the_same_bits(monkeypatch, rule):
    """The running sum turns values into terms TERMS_AT_ONCE at a time (issue #25: a tensor's float64
    and int64 temporaries were 16 bytes a value of the whole tensor): dense and sparse updates, added
    and one taken out again, give the same integers as terms made a whole tensor at a time, and the same
    mean, read a slice at a time too."""
    import btnode.aggregate.sums.accumulate as accumulate

    spec = {n: tuple(t.shape) for n, t in INIT.items()}
    g = torch.Generator().manual_seed(3)
    dense_ = [{n: torch.randn(t.shape, generator=g) * 0.1 for n, t in INIT.items()} for _ in range(3)]
    sparse_ = {}
    for n, t in INIT.items():
        pos = torch.randperm(t.numel(), generator=g)[:max(1, t.numel() // 5)].sort().values
        sparse_[n] = SparseTensor(tuple(t.shape), pos, torch.randn(len(pos), generator=g) * 0.1)

    def summed(at_once: int) -> Accumulator:
        monkeypatch.setattr(accumulate, "TERMS_AT_ONCE", at_once)
        acc = Accumulator(spec, rule, unit=weight_unit(8.0))
        for d, w in zip([*dense_, sparse_], [1.0, 3.0, 0.5, 2.0]):
            acc.add(d, w)
        acc.sub(dense_[1], 3.0)
        acc.means = {n: acc.mean_of(n) for n in spec}  # the mean read a slice at a time too
        return acc

    whole, sliced = summed(1 << 30), summed(7)
    assert all(torch.equal(whole.means[n], sliced.means[n]) for n in spec)
    assert all(t.numel() > 7 for t in INIT.values())  # more than one slice each
    assert set(whole.sum) == set(sliced.sum) and all(torch.equal(whole.sum[n], sliced.sum[n]) for n in whole.sum)
    assert all(torch.equal(whole.reached[n], sliced.reached[n]) for n in whole.reached)
    assert (whole.total, whole.dense_reached, whole.count) == (sliced.total, sliced.dense_reached, sliced.count)


def test_an_update_outside_the_grid_is_refused_before_it_touches_the_sum():
    spec = {n: tuple(t.shape) for n, t in INIT.items()}
    acc = Accumulator(spec, "all", unit=1.0)
    huge = {n: torch.full(t.shape, 2 * MAX_TERM) for n, t in INIT.items()}
    with pytest.raises(MalformedInput) as err:
        acc.add(huge, 1.0)
    assert err.value.reason == "range" and acc.count == 0 and not acc.sum


def test_sketch_cosines_follow_the_true_cosines():
    spec = {n: tuple(t.shape) for n, t in INIT.items()}
    sk = Sketcher(spec, b"key")
    g = torch.Generator().manual_seed(3)
    base = {n: torch.randn(t.shape, generator=g) for n, t in INIT.items()}
    for mix in (0.0, 0.5, 1.0, 2.0):
        other = {n: base[n] + mix * torch.randn(t.shape, generator=g) for n, t in INIT.items()}
        true = sum(float((base[n] * other[n]).sum()) for n in INIT) / (
            sum(float(base[n].square().sum()) for n in INIT) ** 0.5 * sum(float(other[n].square().sum()) for n in INIT) ** 0.5)
        a, b = sk.of(base), sk.of(other)
        est = float(a.dot(b) / (a.norm() * b.norm()))
        assert est == pytest.approx(true, abs=0.05)


def test_a_close_that_fails_midway_rebuilds_its_sum_and_publishes_the_same_version_next_time(tmp_path):
    want = round_of(tmp_path / "clean", list(WORKERS), Codec.INT8).info.sha256
    agg = make(tmp_path / "failing")
    write = agg.store.write
    calls = []

    def full_disk(*args, **kw):
        calls.append(1)
        if len(calls) == 1:
            raise OSError(28, "No space left on device")
        return write(*args, **kw)

    agg.store.write = full_disk
    for w in WORKERS:
        agg.register(w)
    for w in WORKERS[:-1]:
        agg.submit(*pushed(w, Codec.INT8, WORKERS.index(w))[:2], raw=pushed(w, Codec.INT8, WORKERS.index(w))[2])
    head, delta, raw = pushed(WORKERS[-1], Codec.INT8, len(WORKERS) - 1)
    with pytest.raises(OSError):
        agg.submit(head, delta, raw=raw)  # the last report closes the round, and the write fails
    assert agg.info.version == 0 and agg.tick() is not None  # the next tick closes it again
    assert agg.info.sha256 == want


@pytest.mark.parametrize("robust", ["median", "trimmed"])
def test_median_and_trimmed_read_spilled_columns_and_match_the_rule_on_the_held_updates(tmp_path, monkeypatch, robust):
    import btnode.aggregate.round.screen as screen_module
    from btnode.aggregate.sums.averaging import combine

    monkeypatch.setattr(screen_module, "ROBUST_COLUMN_BYTES", 4 * 1000)  # many columns per tensor
    agg = make(tmp_path, robust=robust)
    for w in WORKERS:
        agg.register(w)
    deltas = []
    for w in WORKERS[:-1]:
        head, delta, raw = pushed(w, Codec.INT8, WORKERS.index(w))
        agg.submit(head, delta, raw=raw)
        deltas.append(delta)
    assert all(u.delta is None and u.spilled for u in agg.round.accepted.values())  # on disk, not in memory
    head, delta, raw = pushed(WORKERS[-1], Codec.INT8, len(WORKERS) - 1)
    agg.submit(head, delta, raw=raw)
    deltas.append(delta)
    want, rule = combine(deltas, [1.0] * len(deltas), OuterConfig(robust=robust))
    assert agg.info.version == 1 and rule == robust
    for n, t in INIT.items():
        assert torch.equal(agg.params[n], t + want[n])


def test_an_upload_is_decoded_only_once_a_decode_slot_is_free(tmp_path):
    """--decode-slots: a push received whole waits, compressed, for a slot; only then is it decoded
    and judged (so pushes in flight hold their compressed bytes, not 4 bytes a parameter)."""
    import threading

    from btnode.aggregate.service import SwarmAggregator
    from btnode.codec.frames import encode_frames, iter_chunks
    from btnode.model.config import ModelConfig
    from btnode.train.config import TrainConfig
    from btnode.train.terms import TrainingTerms

    cfg = ModelConfig(d_model=32, n_heads=2, n_layers=1, n_blocks=2, context=32, segments=(1, 8))
    tc = TrainConfig(steps=100, batch=4, warmup=2)
    agg = SwarmAggregator(cfg, AggregatorConfig(round=RoundConfig(deadline_s=30.0), claims=ClaimConfig.of(tc, 4),
                                                decode_slots=1), tmp_path)
    terms = TrainingTerms(train=tc, steps_per_round=4).to_json()
    for w in ("a", "b"):
        agg.join(w, 0, cfg.fingerprint(), "", training_json=terms)
    block = agg.block(0)
    small = {n: torch.zeros(s) for n, s in block.spec.items()}
    head = PushHeader(worker_id="a", block=0, base_version=0, samples=4.0, loss=1.0, codec=Codec.INT8,
                      update_id="a-0", steps=(0,), data_key=agg.keys.of(0)["a"])
    received = []

    def chunks():
        for c in iter_chunks(encode_frames(small, Codec.INT8)):
            yield c
        received.append(True)

    assert agg._decoding.acquire(timeout=1)  # the one slot is busy
    out = []
    t = threading.Thread(target=lambda: out.append(agg.push(head, chunks())))
    t.start()
    t.join(timeout=1.0)
    assert received and t.is_alive() and not block.round.accepted  # uploaded, waiting to be decoded
    agg._decoding.release()
    t.join(timeout=10)
    assert out and out[0].outcome is Outcome.PENDING and "a" in block.round.accepted


def test_a_large_units_push_waits_for_the_one_lazy_slot_holding_no_decode_slot(tmp_path, monkeypatch):
    """A push judged a tensor at a time (a unit over LAZY_DECODE_BYTES: lowered to 0 here) is decoded one at
    a time whatever --decode-slots (2 here), and while it waits its turn it holds none of the decode slots."""
    import threading

    from btnode.aggregate.service import SwarmAggregator
    from btnode.codec.frames import encode_frames, iter_chunks
    from btnode.model.config import ModelConfig
    from btnode.train.config import TrainConfig
    from btnode.train.terms import TrainingTerms

    monkeypatch.setattr("btnode.aggregate.round.intake.LAZY_DECODE_BYTES", 0)
    cfg = ModelConfig(d_model=32, n_heads=2, n_layers=1, n_blocks=2, context=32, segments=(1, 8))
    tc = TrainConfig(steps=100, batch=4, warmup=2)
    agg = SwarmAggregator(cfg, AggregatorConfig(round=RoundConfig(deadline_s=30.0), claims=ClaimConfig.of(tc, 4),
                                                decode_slots=2), tmp_path)
    terms = TrainingTerms(train=tc, steps_per_round=4).to_json()
    agg.join("a", 0, cfg.fingerprint(), "", training_json=terms)
    block = agg.block(0)
    head = PushHeader(worker_id="a", block=0, base_version=0, samples=4.0, loss=1.0, codec=Codec.INT8,
                      update_id="a-0", steps=(0,), data_key=agg.keys.of(0)["a"])
    frames = encode_frames({n: torch.zeros(s) for n, s in block.spec.items()}, Codec.INT8)
    assert agg._decoding_lazy.acquire(timeout=1)  # another large push is being judged
    out = []
    t = threading.Thread(target=lambda: out.append(agg.push(head, iter_chunks(frames))))
    t.start()
    t.join(timeout=1.0)
    assert t.is_alive() and block.info.version == 0  # uploaded, waiting for its turn
    assert agg._decoding.acquire(blocking=False) and agg._decoding.acquire(blocking=False)  # both slots free
    agg._decoding.release()
    agg._decoding.release()
    agg._decoding_lazy.release()
    t.join(timeout=10)
    assert out and out[0].outcome is Outcome.PENDING and block.info.version == 1  # its only replica reported


def test_a_lazy_update_summed_and_sketched_in_one_pass_gives_the_bits_of_separate_passes():
    """Tally.restore decodes each tensor of a lazy update once for the sum and the sketch (LazyDelta.each, one
    reused buffer): the sum and the sketch are those of the decoded update, read twice."""
    from btnode.codec.frames import LazyDelta

    spec = {"a": (300, 7), "b": (1000,), "c": (5,)}
    g = torch.Generator().manual_seed(3)
    raw = {n: encode(Codec.INT8, torch.randn(s, generator=g)) for n, s in spec.items()}
    dense = {n: decode(Codec.INT8, raw[n], s) for n, s in spec.items()}
    lazy = LazyDelta(spec, dict.fromkeys(spec, Codec.INT8), raw, {}, {})
    sketcher = Sketcher(spec, b"key")
    one, two = Accumulator(spec, "senders"), Accumulator(spec, "senders")
    sketch = sketcher.empty()
    one.add(lazy, 3.0, also=lambda n, t: sketcher.add_into(sketch, n, t))
    two.add(dense, 3.0)
    assert all(torch.equal(one.sum[n], two.sum[n]) for n in spec)
    assert torch.equal(sketch, sketcher.of(dense)) and torch.equal(sketcher.of(lazy), sketch)
