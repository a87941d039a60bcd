"""The autoregressive chain: per-stage KV caches give the same bytes as the whole model run from
scratch on every window, across a sliding window and after a re-route to a spare stage."""

import pytest
import torch

from btnode.errors import MalformedInput, PeerUnavailable
from btnode.model.ar import ByteTransformer
from btnode.serve.ar import ARState, LocalARStage, local_ar_chain, split_layers
from btnode.serve.driver import generate_ar
from btnode.serve.stages import FailoverStage


def model(cfg, layers=6, seed=0):
    torch.manual_seed(seed)
    m = ByteTransformer(cfg, layers)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.2)  # well-separated logits: argmax ties cannot hide a wrong cache
    return m.eval()


def reference(m, prompt, n):
    text = bytearray(prompt)
    for _ in range(n):
        window = torch.tensor(list(text[-m.cfg.context:]))[None]
        with torch.no_grad():
            text.append(int(m(window)[0, -1].argmax()))
    return bytes(text[len(prompt):])


def test_split_layers():
    assert split_layers(6, 3) == [(0, 2), (2, 4), (4, 6)]
    assert split_layers(5, 2) == [(0, 2), (2, 5)]


def test_cached_chain_matches_the_whole_model_across_a_sliding_window(tiny_cfg):
    m = model(tiny_cfg)
    prompt = b"the cached chain"
    first = local_ar_chain(m, 3, torch.device("cpu"))
    got = [r for r in generate_ar(first, tiny_cfg, prompt, n_bytes=40, seed=0, temperature=0.0)]
    assert b"".join(r.new_bytes for r in got) == reference(m, prompt, 40)  # 16 + 40 > N = 32: the window slides
    assert all(r.route == ["ar-0-2", "ar-2-4", "ar-4-6"] for r in got)


class Flaky:
    """A remote-looking stage that disappears after `ok` calls (fault injection by wrapping)."""

    def __init__(self, stage, ok):
        self.stage, self.ok, self.name = stage, ok, "flaky"

    def forward(self, state):
        if self.ok <= 0:
            raise PeerUnavailable("gone")
        self.ok -= 1
        return self.stage.forward(state)


def test_a_spare_takes_over_mid_request_and_rebuilds_the_cache(tiny_cfg):
    m = model(tiny_cfg, seed=1)
    last = LocalARStage(m, 4, 6)
    primary = LocalARStage(m, 2, 4, next=last, name="primary")
    spare = LocalARStage(m, 2, 4, next=last, name="spare")
    first = LocalARStage(m, 0, 2, next=FailoverStage([Flaky(primary, 5), spare]))
    got = list(generate_ar(first, tiny_cfg, b"spare me", n_bytes=12, seed=0, temperature=0.0))
    assert b"".join(r.new_bytes for r in got) == reference(m, b"spare me", 12)
    assert got[4].route[1] == "primary" and got[5].route[1] == "spare"


def test_a_malformed_hidden_state_is_refused(tiny_cfg):
    m = model(tiny_cfg)
    mid = LocalARStage(m, 2, 4, next=LocalARStage(m, 4, 6))
    for hidden in (torch.zeros(3, 7), torch.full((2, tiny_cfg.d_model), float("nan")), None):
        with pytest.raises(MalformedInput):
            mid.forward(ARState(request_id="r", tokens=b"ab", step=0, seed=0, temperature=0.0, hidden=hidden))
