import pytest
import torch

from btnode.aggregate.round.rounds import Round, RoundConfig, Update
from btnode.errors import MalformedInput, StaleUpdate
from btnode.protocol import Outcome


def upd(worker, base=5):
    return Update(worker_id=worker, update_id=worker, base_version=base, samples=1.0, loss=0.0,
                  delta={"w": torch.zeros(1)}, weight=1.0)


def test_judging_by_base_version():
    r = Round(version=5, opened_at=0.0, cfg=RoundConfig())
    assert r.judge("a", 5)[0] is Outcome.PENDING
    assert r.judge("a", 4)[0] is Outcome.LATE
    with pytest.raises(StaleUpdate):
        r.judge("a", 3)
    with pytest.raises(MalformedInput, match="ahead"):
        r.judge("a", 6)
    r.add(upd("a"))
    with pytest.raises(MalformedInput, match="already has an accepted update"):
        r.judge("a", 5)


def test_staleness_bound_weights_older_updates_down():
    r = Round(version=5, opened_at=0.0, cfg=RoundConfig(max_staleness=2, staleness_decay=0.5))
    assert r.judge("a", 3)[:2] == (Outcome.PENDING, 0.25)
    assert r.judge("a", 2)[0] is Outcome.LATE
    with pytest.raises(StaleUpdate):
        r.judge("a", 1)


def test_closing_rules():
    cfg = RoundConfig(deadline_s=10.0, min_updates=2)
    r = Round(version=5, opened_at=100.0, cfg=cfg)
    assert r.close_reason(200.0, {"a", "b", "c"}) is None  # none accepted: stays open past the deadline
    r.add(upd("a"))
    assert r.close_reason(200.0, {"a", "b", "c"}) is None  # below min_updates at the deadline
    r.note("b", Outcome.REJECTED, 5)
    r.note("c", Outcome.LATE, 4)  # a late update does not mean c is done with this round
    assert r.close_reason(105.0, {"a", "b", "c"}) is None
    r.add(upd("c"))
    assert r.close_reason(105.0, {"a", "b", "c"}) == "all_reported"
    assert r.close_reason(110.0, {"a", "b", "c", "d"}) == "deadline"
