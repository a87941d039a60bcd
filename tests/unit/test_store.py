"""Checkpoints: bit-exact round trip, atomic writes, and clear errors for every bad file."""

import json

import pytest
import torch
from safetensors.torch import save as st_save

from btnode.errors import CheckpointError, ConfigMismatchError
from btnode.model.config import ModelConfig
from btnode.model.targets import target_table
from btnode.store import files
from btnode.store.models import init_block, load_block, load_blocks, model_meta
from btnode.train.config import TrainConfig
from btnode.train.trainers import BlockTrainer


def _trained(cfg, steps=2):
    tr = BlockTrainer(init_block(cfg, 1, seed=0), TrainConfig(steps=10, warmup=1, batch=2), block=1,
                      table=target_table(cfg), device=torch.device("cpu"))
    for i in range(steps):
        tr.train_step(torch.randint(0, 256, (2, cfg.context + 1)), worker=0)
    return tr


def _save(tr, folder, block=1):
    optim, groups = files.optimizer_tensors(tr.opt)
    files.save(folder, f"block-{block}", tensors=tr.model.state_dict(), optim=optim,
               meta={**model_meta(tr.cfg), "kind": "block", "block": block, "step": tr.step, "optim_groups": groups})


def test_roundtrip_is_bit_exact_with_optimizer_state(tmp_path, tiny_cfg):
    tr = _trained(tiny_cfg)
    _save(tr, tmp_path)
    loaded = load_block(tmp_path, 1, expected=tiny_cfg, with_optim=True)
    for name, t in tr.model.state_dict().items():
        assert torch.equal(loaded.model.state_dict()[name], t) and loaded.model.state_dict()[name].dtype == t.dtype
    ours, _ = files.optimizer_tensors(tr.opt)
    assert set(ours) == set(loaded.optim) and all(torch.equal(ours[k], loaded.optim[k]) for k in ours)
    assert loaded.meta["step"] == 2
    assert not list(tmp_path.glob(".*tmp*")), "temp files left behind"


def test_missing_checkpoint(tmp_path, tiny_cfg):
    with pytest.raises(CheckpointError, match="block-0.json is missing"):
        load_block(tmp_path, 0)
    with pytest.raises(CheckpointError, match="does not exist"):
        load_blocks(tmp_path / "nowhere")


def test_truncated_and_corrupted_tensor_files(tmp_path, tiny_cfg):
    _save(_trained(tiny_cfg), tmp_path)
    path = tmp_path / "block-1.safetensors"
    blob = path.read_bytes()
    path.write_bytes(blob[: len(blob) // 2])
    with pytest.raises(CheckpointError, match="truncated or corrupted"):
        load_block(tmp_path, 1)
    flipped = bytearray(blob)
    flipped[-7] ^= 0xFF
    path.write_bytes(bytes(flipped))
    with pytest.raises(CheckpointError, match="truncated or corrupted"):
        load_block(tmp_path, 1)


def test_truncated_metadata(tmp_path, tiny_cfg):
    _save(_trained(tiny_cfg), tmp_path)
    meta = tmp_path / "block-1.json"
    meta.write_text(meta.read_text()[:40])
    with pytest.raises(CheckpointError, match="unreadable or truncated"):
        load_block(tmp_path, 1)


def test_wrong_shape_tensors_are_named(tmp_path, tiny_cfg):
    tr = _trained(tiny_cfg)
    state = dict(tr.model.state_dict())
    state["head.weight"] = torch.zeros(3, 3)
    del state["in_proj.bias"]
    files.save(tmp_path, "block-1", tensors=state, meta={**model_meta(tiny_cfg), "kind": "block", "block": 1})
    with pytest.raises(CheckpointError, match=r"missing in_proj.bias; head.weight is torch.float32 \(3, 3\)"):
        load_block(tmp_path, 1)


def test_checkpoint_from_another_configuration_names_the_fields(tmp_path, tiny_cfg):
    _save(_trained(tiny_cfg), tmp_path)
    other = ModelConfig(**{**tiny_cfg.to_dict(), "d_model": 64, "segments": tiny_cfg.segments})
    with pytest.raises(ConfigMismatchError, match="d_model: expected 64, got 32"):
        load_block(tmp_path, 1, expected=other)


def test_lying_metadata_is_caught_by_the_shape_check(tmp_path, tiny_cfg):
    """A JSON that claims another config than the tensors it points to is refused, not half-loaded."""
    _save(_trained(tiny_cfg), tmp_path)
    meta_path = tmp_path / "block-1.json"
    meta = json.loads(meta_path.read_text())
    meta["model"]["mlp_ratio"] = 2
    meta["target_sha256"] = model_meta(ModelConfig.from_dict(meta["model"]))["target_sha256"]
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="does not fit the model"):
        load_block(tmp_path, 1)


def test_not_a_safetensors_file(tmp_path, tiny_cfg):
    blob = b"\x00" * 64
    (tmp_path / "block-0.safetensors").write_bytes(blob)
    rec = {"name": "block-0.safetensors", "bytes": 64, "sha256": __import__("hashlib").sha256(blob).hexdigest()}
    (tmp_path / "block-0.json").write_text(json.dumps({"format": 1, "kind": "block", "block": 0,
                                                       **model_meta(tiny_cfg), "files": {"model": rec}}))
    with pytest.raises(CheckpointError, match="not a valid safetensors file"):
        load_block(tmp_path, 0)


def test_atomic_write_replaces_whole_files(tmp_path):
    p = tmp_path / "x.bin"
    files.atomic_write(p, b"one")
    files.atomic_write(p, b"two!")
    assert p.read_bytes() == b"two!" and [q.name for q in tmp_path.iterdir()] == ["x.bin"]
    assert st_save({"a": torch.zeros(1)})  # safetensors available


def test_a_delta_is_read_without_the_model_and_still_hash_checked(tmp_path):
    """FetchDelta reads the delta's file only: with the model's file unreadable the delta still comes
    back, bit for bit; a flipped byte in the delta's own file is caught (issue #25: 48 concurrent
    fetches each read, hashed and deserialised the whole model)."""
    from btnode.codec.codecs import Codec
    from btnode.errors import UnknownBlock
    from btnode.store.versions import VersionStore

    store = VersionStore(tmp_path, 0)
    raw = {"w": bytes(range(64)), "b": b""}
    store.write(1, {"w": torch.randn(4, 4), "b": torch.zeros(3)}, meta={"info": {}}, delta_raw=raw,
                delta_codec=Codec.INT8)
    (store.folder / "v000000000001.safetensors").write_bytes(b"not a model")
    codec, got, meta = store.delta(1)
    assert codec is Codec.INT8 and got == raw and meta["version"] == 1
    codec, meta, pieces = store.delta_pieces(1)  # one tensor at a time, as a fetch streams it
    assert codec is Codec.INT8 and dict(pieces) == raw and meta["version"] == 1
    store.write(0, {"w": torch.zeros(4, 4), "b": torch.zeros(3)}, meta={"info": {}})  # version 0: no delta made it
    for read in (store.delta, store.delta_pieces):
        with pytest.raises(UnknownBlock, match="has no readable delta"):
            read(0)
    with pytest.raises(CheckpointError):
        store.load(1)  # the model's file really is unreadable
    path = store.folder / "v000000000001.delta.safetensors"
    blob = bytearray(path.read_bytes())
    blob[-1] ^= 1
    path.write_bytes(bytes(blob))
    with pytest.raises(UnknownBlock, match="truncated or corrupted"):
        store.delta(1)
    with pytest.raises(UnknownBlock, match="truncated or corrupted"):
        list(store.delta_pieces(1)[2])  # the hash is known only at the end: nothing before it is kept


def test_threads_writing_one_file_at_once_each_rename_their_own_temp_file(tmp_path):
    """Two Joins at once both rewrote training.json (before it became a journal): with one temp name per process, one thread's
    rename took the other's temp file and the second failed (FileNotFoundError, an INTERNAL Join)."""
    import threading

    from btnode.durable import atomic_write

    path, errors = tmp_path / "f.json", []

    def write(i: int) -> None:
        try:
            for j in range(20):
                atomic_write(path, f"{i}-{j}".encode())
        except Exception as exc:  # noqa: BLE001 - collected for the assertion
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert errors == [] and path.read_text().endswith("-19")
    assert [p.name for p in tmp_path.iterdir()] == ["f.json"]  # no temp file left behind


def test_a_journal_appends_a_line_per_change_and_reads_the_last_of_each_name(tmp_path):
    from btnode.durable import Journal

    path = tmp_path / "terms.jsonl"
    j = Journal(path)
    for i in range(50):
        j.put(f"w{i}", {"lr": i})
    size = path.stat().st_size
    j.put("w3", {"lr": 99})
    assert path.stat().st_size - size < 40  # one line, not the whole map again
    assert Journal(path).values == {**{f"w{i}": {"lr": i} for i in range(50)}, "w3": {"lr": 99}}


def test_a_journal_drops_a_torn_last_line_and_refuses_a_corrupt_middle_one(tmp_path):
    from btnode.durable import Journal

    path = tmp_path / "terms.jsonl"
    j = Journal(path)
    j.put("a", 1)
    j.put("b", 2)
    with open(path, "ab") as f:
        f.write(b'["c", 3')  # a crash mid-append
    j = Journal(path)
    assert j.values == {"a": 1, "b": 2}
    j.put("d", 4)  # appended after the torn bytes were cut away
    assert Journal(path).values == {"a": 1, "b": 2, "d": 4}
    path.write_bytes(b'["a",1]\nnot json\n["b",2]\n')
    with pytest.raises(ValueError, match="line 2"):
        Journal(path)


def test_a_journal_compacts_itself_and_folds_in_the_whole_map_of_earlier_versions(tmp_path):
    from btnode.durable import Journal

    legacy, path = tmp_path / "training.json", tmp_path / "training.jsonl"
    legacy.write_text('{"old": "x"}')
    j = Journal(path, legacy=legacy)
    assert j.values == {"old": "x"} and not legacy.exists()
    for i in range(30):
        j.put("hot", i)
    assert len(path.read_bytes().splitlines()) == 31
    j = Journal(path)
    assert j.values == {"old": "x", "hot": 29} and len(path.read_bytes().splitlines()) == 2
