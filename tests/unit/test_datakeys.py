"""Which windows a worker trains is decided by the swarm: the aggregator hands each (block, worker)
a data key at Join, kept across re-joins and restarts, and a worker's update is re-derivable from
(seed, key, steps) by anyone holding the data. Also the data id check at Join."""

from __future__ import annotations

import json

import pytest
import torch

from btnode.aggregate.round.config import AggregatorConfig
from btnode.aggregate.trust.claims import ClaimConfig
from btnode.aggregate.trust.datakeys import KEYS_FILE
from btnode.aggregate.round.rounds import RoundConfig
from btnode.aggregate.service import SwarmAggregator
from btnode.codec.codecs import Codec, decode
from btnode.data.windows import WindowSampler
from btnode.errors import CheckpointError, ConfigError, ConfigMismatchError
from btnode.model.config import ModelConfig
from btnode.protocol import JoinInfo, Outcome, format_steps
from btnode.sim.link import LocalLink
from btnode.store.models import init_unit
from btnode.swarm.worker import BlockWorker, WorkerConfig
from btnode.train.config import TrainConfig
from btnode.train.terms import TrainingTerms
from btnode.train.trainers import unit_trainer

CFG = ModelConfig(d_model=32, n_heads=2, n_layers=1, n_blocks=2, context=32, segments=(1, 8))
TC = TrainConfig(steps=100, batch=4, warmup=2)
CORPUS = bytes(torch.randint(0, 256, (20_000,), generator=torch.Generator().manual_seed(5)).to(torch.uint8).tolist())
H = 4
CPU = torch.device("cpu")


def aggregator(state_dir, **kw) -> SwarmAggregator:
    return SwarmAggregator(CFG, AggregatorConfig(round=RoundConfig(deadline_s=30.0), claims=ClaimConfig.of(TC, H)), state_dir, seed=TC.seed, **kw)


def join(agg: SwarmAggregator, worker: str, block: int = 0, data_id: str = "") -> JoinInfo:
    return agg.join(worker, block, CFG.fingerprint(), json.dumps(CFG.to_dict()), data_id,
                    training_json=TrainingTerms(TC, H).to_json())


def worker(link: LocalLink, worker_id: str, **kw) -> BlockWorker:
    wcfg = WorkerConfig(worker_id=worker_id, block=0, steps_per_round=H, codec=Codec.FP32, **kw)
    return BlockWorker(CFG, TC, wcfg, link, CORPUS, device=CPU)


def windows(key: str, steps: range | tuple[int, ...]) -> list[bytes]:
    sampler = WindowSampler(CORPUS, CFG.context)
    return [bytes(row.to(torch.uint8).tolist()) for s in steps for row in sampler.batch(TC.seed, key, s, TC.batch)]


def test_keys_are_per_block_in_order_of_first_join_and_a_rejoin_keeps_its_key(tmp_path):
    agg = aggregator(tmp_path)
    assert [join(agg, w).data_key for w in ("wb", "wa", "wb")] == ["0/0", "0/1", "0/0"]
    assert join(agg, "wa", block=1).data_key == "1/0"  # the same worker id on another block: another key
    assert agg.keys.of(0) == {"wb": "0/0", "wa": "0/1"}


def test_two_workers_on_one_block_train_disjoint_windows(tmp_path):
    link = LocalLink(aggregator(tmp_path))
    a, b = worker(link, "same-host-1"), worker(link, "same-host-2")
    a.start(), b.start()
    assert (a.data_key, b.data_key) == ("0/0", "0/1")
    ours, theirs = windows(a.data_key, range(H)), windows(b.data_key, range(H))
    assert len(set(ours)) == H * TC.batch and not set(ours) & set(theirs)
    assert windows("0/0", range(H)) == ours  # a pure function of (seed, key, step)


def test_keys_survive_an_aggregator_restart(tmp_path):
    first = aggregator(tmp_path)
    join(first, "wa"), join(first, "wb"), join(first, "wa", block=1)
    record = json.loads((tmp_path / KEYS_FILE).read_text())
    assert record == {"data_id": None, "blocks": {"0": ["wa", "wb"], "1": ["wa"]}}
    again = aggregator(tmp_path)  # a new process on the same state folder
    assert join(again, "wb").data_key == "0/1" and join(again, "wc").data_key == "0/2"
    assert join(again, "wx", block=1).data_key == "1/1"


def replay(agg: SwarmAggregator, key: str, worker_id: str, steps: tuple[int, ...]) -> dict[str, torch.Tensor]:
    """What anyone holding the data computes: θ^0, then one step per listed step on its windows."""
    base = agg.block(0).store.load(0).params
    model = init_unit(CFG, 0, TC.seed)
    model.load_state_dict(base)
    trainer = unit_trainer(CFG, 0, model, TC, device=CPU)
    sampler = WindowSampler(CORPUS, CFG.context)
    for s in steps:
        trainer.step = s
        trainer.train_step(sampler.batch(TC.seed, key, s, TC.batch), worker_id)
    return {n: p.detach() - base[n] for n, p in model.state_dict().items()}


def test_a_workers_first_update_is_rederived_from_seed_key_and_steps(tmp_path):
    agg = aggregator(tmp_path)
    join(agg, "someone-else")  # so that the worker's key is not slot 0
    link = LocalLink(agg)
    w = worker(link, "w")
    w.start()
    w.train_steps(w.steps_due())
    header, raw = w.make_update()
    assert (header.data_key, header.steps) == ("0/1", (0, 1, 2, 3))
    pushed = {n: decode(Codec.FP32, raw[n], w.spec[n]) for n in w.spec}
    again = replay(agg, header.data_key, "w", header.steps)
    assert all(torch.equal(pushed[n], again[n]) for n in pushed)  # bit for bit
    by_id = replay(agg, "w", "w", header.steps)  # the windows the worker id alone would have chosen
    assert not all(torch.equal(pushed[n], by_id[n]) for n in pushed)
    assert w.push(header, raw).outcome is Outcome.PENDING
    assert agg.status().blocks[0].data_keys["w"] == "0/1"  # the key the aggregator handed out, and judged it by


def test_without_a_key_from_the_aggregator_the_worker_draws_by_its_id(tmp_path):
    class OldLink(LocalLink):  # an aggregator from before data keys
        def join(self, *args: object, **kw: str) -> JoinInfo:
            info = super().join(*args, **kw)
            return JoinInfo(current=info.current, deadline_s=info.deadline_s, codecs=info.codecs,
                            max_staleness=info.max_staleness)

    w = worker(OldLink(aggregator(tmp_path)), "w7")
    w.start()
    assert w.data_key == "w7"


def test_a_push_with_another_key_than_its_own_is_refused(tmp_path):
    agg = aggregator(tmp_path)
    link = LocalLink(agg)
    a, b = worker(link, "a"), worker(link, "b")
    a.start(), b.start()
    b.data_key = a.data_key  # b trains a's windows
    b.train_steps(H)
    j = b.push(*b.make_update())
    assert j.outcome is Outcome.REJECTED and "data key '0/0', but its key here is '0/1'" in j.reason
    assert agg.block(0).counters[("rejected", "data_key")] == 1


def test_the_first_stated_data_id_becomes_the_swarms_and_others_are_refused(tmp_path):
    agg = aggregator(tmp_path)
    join(agg, "old")  # a worker that states none is not checked, and records nothing
    assert agg.keys.data_id is None
    join(agg, "a", data_id="sha256:aa")
    with pytest.raises(ConfigMismatchError, match="trains on data sha256:bb, but this swarm trains on sha256:aa"):
        join(agg, "b", data_id="sha256:bb")
    assert agg.counters[("join_refused", "data")] == 1 and "b" not in agg.keys.of(0)
    assert aggregator(tmp_path).keys.data_id == "sha256:aa"  # kept across a restart
    assert agg.status().data_id == "sha256:aa"


def test_a_fixed_data_id_refuses_the_first_worker_too_and_must_match_the_state_folder(tmp_path):
    agg = aggregator(tmp_path, data_id="bundled:wikitext-2")
    with pytest.raises(ConfigMismatchError, match="files:corpus.txt=9"):
        join(agg, "a", data_id="files:corpus.txt=9")
    join(agg, "b", data_id="bundled:wikitext-2")
    with pytest.raises(ConfigError, match="--data-id files:x=1 differs from the data id bundled:wikitext-2"):
        aggregator(tmp_path, data_id="files:x=1")


def test_a_damaged_key_record_is_a_clear_error(tmp_path):
    aggregator(tmp_path)
    (tmp_path / KEYS_FILE).write_text('{"data_id": null, "blocks": {"0": "ab"')
    with pytest.raises(CheckpointError, match="cannot be read as the swarm's data keys"):
        aggregator(tmp_path)


def test_steps_are_logged_as_runs():
    assert format_steps((4, 5, 6, 9, 11, 12)) == "4-6,9,11-12" and format_steps(()) == "none"
