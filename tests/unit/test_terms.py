"""A worker states its training terms at Join (train/terms.py); the aggregator refuses one whose
swarm-wide training settings differ from the claims it judges by, records the rest, and refuses a
push from a worker id that never joined the block."""

from __future__ import annotations

import json

import pytest
import torch

from btnode.aggregate.round.config import AggregatorConfig
from btnode.aggregate.trust.claims import ClaimConfig
from btnode.aggregate.service import SwarmAggregator
from btnode.codec.codecs import Codec
from btnode.codec.frames import encode_frames, iter_chunks
from btnode.errors import ConfigMismatchError, MalformedInput, Refused
from btnode.model.config import ModelConfig
from btnode.protocol import Outcome, PushHeader
from btnode.train.config import Precision, TrainConfig
from btnode.train.terms import TrainingTerms

CFG = ModelConfig(d_model=32, n_heads=2, n_layers=1, n_blocks=2, context=32, segments=(1, 8))
TC = TrainConfig(batch=4, lr=5e-3, steps=40, warmup=2)
H = 4
CLAIMS = ClaimConfig.of(TC, H)
GOOD = json.loads(TrainingTerms(TC, H).to_json())


def aggregator(state_dir, claims: ClaimConfig = CLAIMS) -> SwarmAggregator:
    return SwarmAggregator(CFG, AggregatorConfig(claims=claims), state_dir)


def join(agg: SwarmAggregator, worker: str, training_json: str, block: int = 0):
    return agg.join(worker, block, CFG.fingerprint(), json.dumps(CFG.to_dict()), training_json=training_json)


def push(agg: SwarmAggregator, worker: str, block: int = 0):
    """An honest update of H steps, each value moved 1e-3 (a step of lr 5e-3 may move 0.0058)."""
    header = PushHeader(worker_id=worker, block=block, base_version=0, samples=float(H * TC.batch), loss=1.0,
                        codec=Codec.FP32, update_id=f"{worker}:0", steps=tuple(range(H)))
    delta = {n: torch.full(s, 1e-3) for n, s in agg.block(block).spec.items()}
    return agg.push(header, iter_chunks(encode_frames(delta, Codec.FP32)))


def test_terms_round_trip_through_json_with_every_setting():
    terms = TrainingTerms(TrainConfig(batch=3, lr=1e-3, steps=17, warmup=0, seed=9, k1_share=None, ctx_share=0.5,
                                      precision=Precision.BF16), 7)
    doc = json.loads(terms.to_json())
    assert doc["precision"] == "bf16" and doc["steps_per_round"] == 7 and doc["k1_share"] is None
    assert set(doc) == {f for f in TrainConfig.__dataclass_fields__} | {"steps_per_round"}
    assert TrainingTerms.from_json(terms.to_json()) == terms


@pytest.mark.parametrize("text, match", [
    ("{not json", "not JSON"),
    ("[1, 2]", "must be a JSON object"),
    (json.dumps({**GOOD, "momentum": 0.9}), r"unknown fields \['momentum'\]"),
    (json.dumps({k: v for k, v in GOOD.items() if k != "beta2"}), r"missing \['beta2'\]"),
    (json.dumps({**GOOD, "batch": "4"}), "batch = '4' is not of type"),
    (json.dumps({**GOOD, "batch": 4.5}), "batch = 4.5"),
    (json.dumps({**GOOD, "seed": True}), "seed = True"),
    (json.dumps({**GOOD, "k1_share": "most"}), "k1_share = 'most'"),
    (json.dumps({**GOOD, "precision": "fp8"}), "precision = 'fp8'"),
    (json.dumps({**GOOD, "steps_per_round": 0}), "steps_per_round must be a positive integer"),
    (json.dumps({**GOOD, "batch": 0}), "refused: invalid training settings"),
    (json.dumps(GOOD).replace('"lr": 0.005', '"lr": NaN'), "NaN is not a number"),
    (json.dumps({**GOOD, "pad": "x" * 5000}), "over 4096"),
])
def test_terms_other_than_to_json_writes_are_malformed(text, match):
    with pytest.raises(MalformedInput, match=match) as err:
        TrainingTerms.from_json(text)
    assert err.value.reason == "training"


def test_join_refuses_other_swarm_wide_training_settings_naming_each(tmp_path):
    agg = aggregator(tmp_path)
    theirs = TrainingTerms(TrainConfig(batch=8, lr=1e-3, steps=40, warmup=2), H)
    with pytest.raises(ConfigMismatchError, match=r"batch: swarm has 4, worker has 8, lr: swarm has 0.005, worker "
                                                  r"has 0.001\)") as err:
        join(agg, "w", theirs.to_json())
    assert [f[0] for f in err.value.fields] == ["batch", "lr"]
    with pytest.raises(ConfigMismatchError, match="steps_per_round: swarm has 4, worker has 5"):
        join(agg, "w", TrainingTerms(TC, H + 1).to_json())
    with pytest.raises(ConfigMismatchError, match="'w' states no training settings"):
        join(agg, "w", "")
    with pytest.raises(MalformedInput, match="not JSON"):
        join(agg, "w", "{")
    assert agg.counters[("join_refused", "training")] == 4
    assert agg.block(0).registered == set() and agg.keys.of(0) == {} and agg.training("w") is None


def test_an_admitted_workers_terms_are_recorded_with_its_local_schedule(tmp_path):
    agg = aggregator(tmp_path)
    own = TrainingTerms(TrainConfig(batch=4, lr=5e-3, steps=400, warmup=40, seed=3, precision=Precision.BF16), H)
    join(agg, "w", own.to_json())  # its schedule, seed and precision are its own: only the claims' settings must match
    assert agg.training("w") == own and agg.training("other") is None
    assert push(agg, "w").outcome is Outcome.PENDING


def test_believed_claims_admit_any_training_settings_and_still_record_them(tmp_path):
    agg = aggregator(tmp_path, ClaimConfig(enforce=False))
    theirs = TrainingTerms(TrainConfig(batch=8), 3)
    join(agg, "w", theirs.to_json())
    join(agg, "old", "")  # an older worker states none
    assert agg.training("w") == theirs and agg.training("old") is None
    assert agg.block(0).registered == {"w", "old"} and not agg.counters[("join_refused", "training")]


def test_a_push_from_a_worker_that_never_joined_the_block_is_refused(tmp_path):
    agg = aggregator(tmp_path)
    join(agg, "w", TrainingTerms(TC, H).to_json(), block=1)  # another block's join does not count
    with pytest.raises(Refused, match="'w' pushed to block 0 without joining it") as err:
        push(agg, "w")
    assert err.value.reason == "not_joined" and agg.block(0).counters[("rejected", "not_joined")] == 1
    assert agg.block(0).info.version == 0 and not agg.block(0).round.accepted


def test_a_worker_that_joined_before_a_restart_may_still_push(tmp_path):
    join(aggregator(tmp_path), "w", TrainingTerms(TC, H).to_json())
    again = aggregator(tmp_path)  # a new process on the same state folder: the data keys are durable
    assert push(again, "w").outcome is Outcome.PENDING
