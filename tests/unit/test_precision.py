"""`--precision`: bf16 autocasts the forward pass and loss while parameters, gradients and AdamW state
stay fp32; fp32 (the default) is bit for bit the training step it was before the flag existed."""

from __future__ import annotations

import hashlib

import pytest
import torch

from btnode.errors import ConfigError
from btnode.model.config import ModelConfig
from btnode.model.targets import target_table
from btnode.settings import build, to_flags
from btnode.store.models import init_ar, init_block
from btnode.train.config import Precision, TrainConfig
from btnode.train.trainers import ARTrainer, BlockTrainer

# ctx_head 0 and noisy_rows 1 (below): the step before issue #42's levers, which the golden hashes are of
CFG = ModelConfig(d_model=32, n_heads=2, n_layers=1, n_blocks=3, context=32, segments=(1, 8), ctx_head=0)
TEXT = (b"The block trains on its own noise interval and never sees another block's weights. "
        b"A worker pushes the difference of its parameters after H steps; the aggregator averages "
        b"the differences it accepted and writes the next version of the block. ") * 4
CPU = torch.device("cpu")
# The fp32 path computed at commit 4c67c5d (before --precision existed), one thread: sha256 of the
# parameters after STEPS steps of `trained(...)` with TrainConfig(batch=4, warmup=2, steps=20). A
# change of the fp32 step's arithmetic (or of torch's CPU kernels: a torch upgrade may need a new hash,
# computed from a checkout of that commit) changes it.
GOLDEN_STEPS = 3
# The hash depends on which CPU kernels torch picks, which depends on the host, not only on the CPU
# capability torch reports: so each capability has the hashes the code before the flag gave on each host
# it was taken on, and this code must give one of them. AVX512: the first host (at the commit before the
# flag), and an AMD EPYC host reporting AVX512 (485ff50^ and this code gave the same parameters there,
# bit for bit, 2026-12-06); AVX2: an AMD EPYC host (485ff50^ and this code, bit for bit).
GOLDENS = {"AVX512": {"block": {"b497cb9f87b6b16c615860cbb163b9ce923e94adba22e55738efffefd3eb8186",
                                "0518a19d7562f816e68eeca2383d1de5d7a9b297eb9fe047e51ed3d7d5900ab2"},
                      "ar": {"065a0ebb2393230f5ae6c46dfd359e665df0379edaf9e627eceed90f2774a410",
                             "36123111e12d01cf32fda91a31d26341a8ef0ee2e41b416eff6234f9656bfa83"}},
           "AVX2": {"block": {"96b21d569344d25e9c0bf8a228f3f283ad0bd68505ebddb1bed5505592a45d26"},
                    "ar": {"a5d6a35e1bc5a06aa388f28d9b9ee1df56c1264338fb050b1136a9a06049f046"}}}
# |CE(bf16) − CE(fp32)| after CE_STEPS steps on the same windows, noise and σ (CE falls from 5.55 to
# ≈ 4.3 nats). Measured on this shape over seeds 0–3: ≤ 0.004 nats for the block (≤ 0.004 at any step),
# ≤ 0.0005 for the AR model. The tolerance is 5× the worst of those: bf16 rounds to 8 bits of mantissa,
# so a small seed-dependent drift is expected; a step that parts from fp32 is not.
CE_STEPS, CE_TOLERANCE = 20, 0.02


def windows(step: int, batch: int = 4) -> torch.Tensor:
    """(batch, N+1) byte windows of TEXT, a pure function of `step` (independent of the data layer)."""
    g = torch.Generator().manual_seed(1000 + step)
    starts = torch.randint(0, len(TEXT) - CFG.context - 1, (batch,), generator=g)
    data = torch.tensor(list(TEXT))
    return data[starts[:, None] + torch.arange(CFG.context + 1)[None, :]]


def trainer(kind: str, tc: TrainConfig) -> BlockTrainer | ARTrainer:
    if kind == "block":
        return BlockTrainer(init_block(CFG, 0, tc.seed), tc, block=0, table=target_table(CFG), device=CPU)
    return ARTrainer(init_ar(CFG, 3, tc.seed), tc, CPU)


def trained(kind: str, steps: int, **train: object) -> tuple[BlockTrainer | ARTrainer, list[float]]:
    """A trainer after `steps` steps on `windows`, and the CE of each step."""
    tr = trainer(kind, TrainConfig(batch=4, warmup=2, steps=20, noisy_rows=1.0, **train))  # type: ignore[arg-type]
    return tr, [tr.train_step(windows(step)).ce for step in range(steps)]


def digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode() + tensor.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


@pytest.mark.parametrize("kind", ["block", "ar"])
def test_fp32_is_the_step_it_was_before_the_flag(kind):
    default, _ = trained(kind, GOLDEN_STEPS)
    explicit, _ = trained(kind, GOLDEN_STEPS, precision="fp32")
    assert digest(default.model) == digest(explicit.model)
    golden = GOLDENS.get(torch.backends.cpu.get_cpu_capability())
    if golden is None:
        pytest.skip(f"no golden hash taken on a {torch.backends.cpu.get_cpu_capability()} CPU (the fp32 and "
                    f"default steps were compared above)")
    assert digest(default.model) in golden[kind], "a new host? compute its hash from a checkout of 485ff50^"


@pytest.mark.parametrize("kind", ["block", "ar"])
def test_bf16_trains_fp32_master_weights(kind):
    tr, _ = trained(kind, 2, precision=Precision.BF16)
    fp32, _ = trained(kind, 2)
    assert all(p.dtype == torch.float32 and p.grad is not None and p.grad.dtype == torch.float32
               for p in tr.model.parameters())
    state = [t for s in tr.opt.state.values() for t in s.values() if t.ndim > 0]
    assert state and all(t.dtype == torch.float32 for t in state)
    # autocast really ran: the same windows and noise give other (nearby) parameters
    assert digest(tr.model) != digest(fp32.model)
    gap = max((a - b).abs().max().item() for a, b in zip(tr.model.parameters(), fp32.model.parameters()))
    assert 0 < gap < 1e-2


@pytest.mark.parametrize("kind", ["block", "ar"])
def test_bf16_ce_is_close_to_fp32(kind):
    _, bf16 = trained(kind, CE_STEPS, precision="bf16")
    _, fp32 = trained(kind, CE_STEPS)
    assert fp32[-1] < fp32[0] - 0.5  # it learned something, so the comparison means something
    assert abs(bf16[-1] - fp32[-1]) < CE_TOLERANCE, (bf16[-1], fp32[-1])


def test_the_flag_parses_and_round_trips():
    tc = build(TrainConfig, {"precision": "bf16"})
    assert tc.precision is Precision.BF16 and ["--precision", "bf16"] == to_flags(tc)[-2:]
    assert build(TrainConfig, {}).precision is Precision.FP32
    with pytest.raises(ConfigError, match=r"--precision must be one of \['fp32', 'bf16'\], got 'fp16'"):
        build(TrainConfig, {"precision": "fp16"})
