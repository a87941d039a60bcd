"""Which weights a chain of separate stages serves, as its entry's Info reports them: every block's
hash in chain order (the same Weights as the blocks linked in one process, so a proxy and `btnode
serve` give one checkpoint one id), the newest version on the chain and the entry's checkpoint name;
an AR chain's stages hold one model, counted once; a chain whose next stage does not answer reports
no hashes (the proxy then falls back to the shape's id) instead of failing Info."""

import asyncio

import torch

from btnode.model.ar import ByteTransformer
from btnode.model.block import DiffusionBlock
from btnode.model.config import ModelConfig
from btnode.rpc.entry import EntryClient
from btnode.rpc.stages import RemoteARStage, RemoteBlockStage, serve_stage
from btnode.serve.ar import LocalARStage
from btnode.serve.identity import ModelIdentity, Origin, chain_sha256
from btnode.serve.stages import FailoverStage, LocalBlockStage, local_chain
from btnode.store.files import state_sha256

CFG = ModelConfig(d_model=32, n_heads=2, n_layers=1, n_blocks=3, context=32, segments=(1, 8))


def served(stages_from_last, make):
    """Serve stages from the last to the first, each linked to the one served before it; the entry's address."""
    servers, nxt = [], None
    for i in stages_from_last:
        server, port, _ = serve_stage(make(i, nxt), "127.0.0.1:0")
        servers.append(server)
        nxt = f"127.0.0.1:{port}"
    return servers, nxt


def info(address):
    return asyncio.run(EntryClient([address]).info())


def test_the_entry_reports_every_blocks_hash_in_order_as_the_local_chain_does():
    torch.manual_seed(0)
    blocks = [DiffusionBlock(CFG).eval() for _ in range(3)]
    versions = {0: 5, 1: 7, 2: 6}  # blocks of an aggregator's state folder may stand at different versions

    def make(i, nxt):
        return LocalBlockStage(blocks[i], i, 3, next=FailoverStage([RemoteBlockStage(nxt)]) if nxt else None,
                               origin=Origin(name=f"ckpt{i}", version=versions[i]))

    servers, entry = served((2, 1, 0), make)
    try:
        w = info(entry).weights
    finally:
        for s in servers:
            s.stop(None)
    assert w is not None and w.units == tuple(state_sha256(b.state_dict()) for b in blocks)
    assert (w.name, w.version) == ("ckpt0", 7)  # the entry's name, the newest version on the chain
    local = local_chain(blocks, torch.device("cpu"), origin=Origin(name="ckpt0", version=7)).weights()
    assert local == w and ModelIdentity.of(w).id == f"ckpt0-v7-{chain_sha256(w.units)[:8]}"


def test_an_ar_chain_counts_its_one_model_once_and_a_silent_next_stage_leaves_the_weights_unknown():
    cfg = ModelConfig(d_model=32, n_heads=2, n_layers=1, n_blocks=2, context=32, segments=(1,), kind="ar", ar_layers=2)
    model = ByteTransformer(cfg, 2).eval()

    def make(i, nxt):
        return LocalARStage(model, i, i + 1, next=FailoverStage([RemoteARStage(nxt)]) if nxt else None,
                            origin=Origin(name="ar6", version=3))

    servers, entry = served((1, 0), make)
    try:
        w = info(entry).weights
        assert w is not None and w.units == (state_sha256(model.state_dict()),) and w.version == 3
        servers[0].stop(None).wait()  # the last stage is gone: Info still answers, without hashes
        assert info(entry).weights is None
    finally:
        for s in servers:
            s.stop(None)
