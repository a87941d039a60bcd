"""`Fold`, the worker's carry as a value: what it holds after each event of a round, the carry it
computes, and its invariants (tests/unit/test_worker_fold.py drives it through a real worker)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from btnode.swarm.fold import Fold, Trained

H = 4


def theta(x: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((2, 3), x), "b": torch.arange(3.0) + x}


def trained(fold: Fold, *ces: float) -> Fold:
    """Steps numbered on from the last one the fold holds."""
    last = max((t.step for t in fold.pending + fold.in_flight), default=-1)
    for i, ce in enumerate(ces, start=last + 1):
        fold = fold.trained(i, ce)
    return fold


def ces(steps: tuple[Trained, ...]) -> tuple[float, ...]:
    return tuple(t.ce for t in steps)


def test_steps_accumulate_until_the_round_is_due():
    fold = Fold()
    assert fold.due(H) == H and fold.pending == () and fold.origin is None and not fold.carries
    fold = trained(fold, 1.0, 2.0, 3.0)
    assert ces(fold.pending) == (1.0, 2.0, 3.0) and fold.due(H) == 1
    assert trained(fold, 4.0, 5.0).due(H) == 0  # more than H pending (a refused update folded back): push at once


def test_sending_moves_the_pending_steps_in_flight_and_reports_their_mean():
    fold = trained(Fold(), 1.0, 2.0, 4.5)
    assert fold.loss == sum([1.0, 2.0, 4.5]) / 3
    sent = fold.sent()
    assert sent.pending == () and ces(sent.in_flight) == (1.0, 2.0, 4.5) and sent.due(H) == H
    with pytest.raises(AssertionError):
        _ = sent.loss


def test_accepted_carries_only_what_was_trained_after_the_push():
    at_push = theta(1.0)
    fold = trained(trained(Fold(), 1.0, 1.0).sent(), 0.5).accepted(at_push)
    assert ces(fold.pending) == (0.5,) and fold.in_flight == () and fold.origin is at_push and fold.carries
    carry = fold.carry(theta(3.0))
    assert set(carry) == {"w", "b"} and all(torch.equal(c, torch.full_like(c, 2.0)) for c in carry.values())
    landed = fold.landed()
    assert ces(landed.pending) == (0.5,) and landed.origin is None and not landed.carries  # the next update carries it


def test_refused_folds_the_whole_update_back_in_from_the_base():
    base = theta(0.0)
    fold = trained(trained(Fold(), 1.0, 2.0).sent(), 3.0).refused(base, 8)
    assert ces(fold.pending) == (1.0, 2.0, 3.0) and fold.in_flight == () and fold.origin is base  # pushed steps first
    assert fold.steps == (0, 1, 2)  # and their numbers with them: the next update names its windows
    assert torch.equal(fold.carry(theta(0.25))["w"], torch.full((2, 3), 0.25))
    assert ces(fold.landed().pending) == (1.0, 2.0, 3.0)


def test_refused_with_nothing_trained_since_still_carries_the_update():
    fold = trained(Fold(), 1.0).sent().refused(theta(0.0), 8)
    assert fold.carries and ces(fold.pending) == (1.0,)


def test_no_carry_without_steps_since_the_origin():
    fold = trained(Fold(), 1.0).sent().accepted(theta(1.0))
    assert fold.origin is not None and not fold.carries
    assert fold.landed().pending == () and fold.landed().origin is None


def test_idle_drops_the_origin_and_landing_drops_what_was_trained():
    fold = trained(trained(Fold(), 1.0).sent(), 2.0, 3.0).idle()
    assert fold.origin is None and fold.in_flight == () and not fold.carries
    assert ces(fold.pending) == (2.0, 3.0)  # still counted until the version lands ...
    assert fold.landed().pending == ()  # ... then the worker adopts it exactly and starts afresh
    refused_then_idle = trained(Fold(), 1.0).sent().refused(theta(0.0), 8).idle()
    assert refused_then_idle.origin is None and refused_then_idle.landed().pending == ()


def test_carry_needs_an_origin():
    with pytest.raises(AssertionError):
        Fold(pending=(Trained(0, 1.0),)).carry(theta(1.0))


def test_a_fold_is_never_changed_in_place():
    fold = trained(Fold(), 1.0)
    later = fold.trained(1, 2.0).sent().accepted(theta(0.0))
    assert ces(fold.pending) == (1.0,) and fold.in_flight == () and fold.origin is None
    assert later is not fold
    with pytest.raises(dataclasses.FrozenInstanceError):
        fold.pending = ()  # type: ignore[misc]
