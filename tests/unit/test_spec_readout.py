"""Readout "spec": block 0 drafts a segment, every block scores the draft in the same traversal,
the last stage keeps what speculative sampling accepts under the pooled blocks and fills the rest."""

import copy
import dataclasses

import pytest
import torch

from btnode.errors import InputError, MalformedInput
from btnode.model.block import DiffusionBlock
from btnode.model.layout import generation_layout
from btnode.model.sampler import context_logits, log_probs
from btnode.seeding import generator
from btnode.serve.driver import generate
from btnode.serve.readouts import Carry, accept_draft, autoregress
from btnode.serve.request import GenerationRequest
from btnode.serve.stages import SegmentState, local_chain


def emitted(p: torch.Tensor, q: torch.Tensor, n: int, temperature: float = 1.0) -> torch.Tensor:
    """Counts of (first emitted byte, second emitted byte or V when the first was a replacement) over
    n drafts of two rows drawn from q, each run through accept_draft against p."""
    v = p.shape[-1]
    counts = torch.zeros(v, v + 1)
    draw = torch.Generator().manual_seed(123)
    qs = torch.softmax(q / temperature, -1)
    for i in range(n):
        draft = bytes(int(torch.multinomial(qs[j], 1, generator=draw)[0]) for j in range(2))
        kept, fix = accept_draft(p, q, draft, temperature, torch.Generator().manual_seed(i))
        out = draft[:kept] + (bytes([fix]) if fix is not None else b"")
        counts[out[0], out[1] if len(out) > 1 and kept >= 1 else v] += 1
    return counts / n


def test_accept_draft_emits_exactly_the_target_distribution():
    """The kept prefix plus the replacement is a sample of p row by row, whatever the draft's q
    (here far from p: keeping every draft byte would emit q, 0.35 away in total variation)."""
    p = torch.log(torch.tensor([[0.5, 0.2, 0.2, 0.1], [0.1, 0.1, 0.2, 0.6]]))
    q = torch.log(torch.tensor([[0.1, 0.1, 0.3, 0.5], [0.25, 0.25, 0.25, 0.25]]))
    freq = emitted(p, q, 20000)
    first = freq.sum(1)
    assert (first - p[0].exp()).abs().max() < 0.02
    assert (torch.softmax(q[0], -1) - p[0].exp()).abs().sum() / 2 > 0.3  # a rule that kept q would fail
    second = freq[:, :4].sum(0) / freq[:, :4].sum()  # the second byte, where the first was kept
    assert (second - p[1].exp()).abs().max() < 0.03


def test_accept_draft_at_temperature_and_greedy():
    p = torch.log(torch.tensor([[0.5, 0.3, 0.1, 0.1]]))
    q = torch.log(torch.tensor([[0.1, 0.2, 0.3, 0.4]]))
    first = emitted(torch.cat([p, p]), torch.cat([q, q]), 8000, temperature=0.5).sum(1)
    assert (first - torch.softmax(p[0] / 0.5, -1)).abs().max() < 0.03
    g = torch.Generator()
    assert accept_draft(torch.cat([p, p]), torch.cat([q, q]), bytes([0, 0]), 0.0, g) == (2, None)
    assert accept_draft(torch.cat([p, p]), torch.cat([q, q]), bytes([0, 3]), 0.0, g) == (1, 0)
    assert accept_draft(p, q, bytes([2]), 0.0, g) == (0, 0)


def chain_of(blocks):
    return local_chain(blocks, torch.device("cpu"))


def drive(first, cfg, n_blocks, prompt, **kw):
    return generate(first, cfg, n_blocks, GenerationRequest(prompt, **kw))


@pytest.mark.parametrize("readout", ["spec", "spec-fill"])
def test_a_chain_of_one_block_three_times_keeps_every_draft_byte(tiny_cfg, readout):
    """When every block is the same block, the pool is the draft's own distribution, so every draft
    byte is kept and the output is block 0's autoregressive draft; `accepted` says so."""
    torch.manual_seed(4)
    one = DiffusionBlock(tiny_cfg).eval()
    blocks = [one, copy.deepcopy(one), copy.deepcopy(one)]
    first = chain_of(blocks)
    prompt, k, seed = b"a prompt", 8, 9
    res = list(drive(first, tiny_cfg, 3, prompt, n_bytes=16, k=k, n_steps=7, seed=seed, temperature=1.0,
                     readout=readout))
    assert [r.accepted for r in res] == [8, 8] and [r.route for r in res][0] == ["block-0", "block-1", "block-2"]
    cache = one.encode_context(torch.tensor([list(prompt)]))
    draft, _ = autoregress(one, cache, k, 1.0, generator("spec-draft", seed, 0))
    assert res[0].new_bytes == draft


@pytest.mark.parametrize("readout", ["spec", "spec-fill"])
def test_spec_rows_are_the_pooled_context_readouts_of_every_block(tiny_cfg, readout):
    """The logits a spec segment reports are, row by row, the mean log-probability of every block's
    context readout given the context and the bytes before the row (recomputed here from scratch,
    on the rows whose prefix is the kept draft); the bytes are seeded. "spec" stops after the first
    replacement; "spec-fill" serves the whole segment."""
    torch.manual_seed(5)
    blocks = [DiffusionBlock(tiny_cfg).eval() for _ in range(tiny_cfg.n_blocks)]
    with torch.no_grad():  # untrained blocks read near-uniform and agree; sharpened, they disagree
        for b in blocks:
            b.logit_scale.fill_(40.0)
    first = chain_of(blocks)
    prompt, k = b"some context", 16
    kw = dict(n_bytes=k, k=k, n_steps=7, seed=2, temperature=1.0, readout=readout, want_logits=True)
    res = next(iter(drive(first, tiny_cfg, 3, prompt, **kw)))
    assert 0 <= res.accepted < k  # random blocks disagree: some draft byte is rejected
    assert len(res.new_bytes) == (k if readout == "spec-fill" else res.accepted + 1)
    for j in range(min(res.accepted + 1, k)):
        ctx = torch.tensor([list(prompt + res.new_bytes[:j])])
        rows = [log_probs(context_logits(b, b.encode_context(ctx), generation_layout(ctx.shape[1], 1)))[0, 0]
                for b in blocks]
        assert torch.allclose(res.logits[j], sum(rows) / 3, atol=1e-4), j
    again = next(iter(drive(first, tiny_cfg, 3, prompt, **kw)))
    assert again.new_bytes == res.new_bytes and again.accepted == res.accepted
    greedy = [next(iter(drive(first, tiny_cfg, 3, prompt, **{**kw, "temperature": 0.0}))).new_bytes for _ in range(2)]
    assert greedy[0] == greedy[1]
    whole = list(drive(first, tiny_cfg, 3, prompt, **{**kw, "n_bytes": 40}))
    assert sum(len(r.new_bytes) for r in whole) == 40 and all(1 <= len(r.new_bytes) <= k for r in whole)


def test_a_stage_refuses_a_spec_state_it_cannot_trust(tiny_cfg):
    blocks = [DiffusionBlock(tiny_cfg).eval() for _ in range(tiny_cfg.n_blocks)]
    second = chain_of(blocks).next
    good = Carry(draft=bytes(8), draft_logp=torch.full((8, 256), -5.5), pool=torch.full((8, 256), -5.5))
    base = SegmentState(request_id="r", context=b"hi", segment=0, k=8, n_steps=7, seed=0, temperature=1.0,
                        z=torch.zeros(8, tiny_cfg.d_model), readout="spec", carry=good)
    bad = [({"draft": b""}, "draft is missing"), ({"draft_logp": None}, "draft is missing"),
           ({"draft": bytes(7)}, "draft of 7 bytes"), ({"pool": None}, "missing"),
           ({"draft_logp": torch.zeros(8, 255)}, "expected float32"),
           ({"draft_logp": torch.full((8, 256), float("inf"))}, "finite"),
           ({"draft_logp": torch.full((8, 256), 0.5)}, "finite")]
    for change, match in bad:
        with pytest.raises(MalformedInput, match=match):
            second.forward(dataclasses.replace(base, carry=dataclasses.replace(good, **change)))
    with pytest.raises(MalformedInput, match="draft is unexpected"):
        second.forward(dataclasses.replace(base, readout="pool", carry=dataclasses.replace(good, draft_logp=None)))
    with pytest.raises(MalformedInput, match="draft is unexpected"):
        chain_of(blocks).forward(dataclasses.replace(base, carry=dataclasses.replace(good, pool=None)))  # block 0 drafts; it takes none
    assert 1 <= len(second.forward(base).new_bytes) <= 8
    assert len(second.forward(dataclasses.replace(base, readout="spec-fill")).new_bytes) == 8
    spec = dict(n_bytes=8, n_steps=7, seed=0, temperature=1.0, readout="spec")
    assert len(b"".join(r.new_bytes for r in drive(chain_of(blocks), tiny_cfg, 3, b"hi", k=5, **spec))) == 8  # any K ≤ N/2
    for k in (0, 17):
        with pytest.raises(InputError, match="drafts 1 … 16"):
            drive(chain_of(blocks), tiny_cfg, 3, b"hi", k=k, **spec).__next__()
    with pytest.raises(InputError, match="tail"):
        drive(chain_of(blocks), tiny_cfg, 3, b"hi", n_bytes=8, k=8, n_steps=7, seed=0, temperature=1.0,
              readout="spec", n_tail=2).__next__()
