"""The autoregressive chain: per-stage KV caches give the same bytes as the whole model run from
scratch on every window (across window restarts) and after a re-route to a spare stage;
speculative decoding gives the same bytes as plain decoding, bit for bit; caches rewind, and stay
within their bounds under a flood of request ids; bad drafts and states are refused."""

import copy

import pytest
import torch

from btnode.errors import CacheMiss, ConfigError, InputError, MalformedInput, PeerUnavailable
from btnode.model.ar import ByteTransformer
from btnode.model.config import ModelConfig
from btnode.serve.ar import ARState, LocalARStage, local_ar_chain, max_draft, split_layers
from btnode.serve.draft import ARDrafter
from btnode.serve.driver import generate_ar
from btnode.serve.request import GenerationRequest
from btnode.serve.stages import FailoverStage, SegmentResult
from btnode.serve.window import keep_bytes, window_start

CPU = torch.device("cpu")


def model(cfg, layers=6, seed=0):
    torch.manual_seed(seed)
    m = ByteTransformer(cfg, layers)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.2)  # well-separated logits: argmax ties cannot hide a wrong cache
    return m.eval()


def near_copy(m, noise=0.05, seed=9):
    """A draft close to the target (the same model with perturbed weights): accepts some, not all."""
    torch.manual_seed(seed)
    d = copy.deepcopy(m)
    with torch.no_grad():
        for p in d.parameters():
            p.add_(noise * torch.randn_like(p))
    return d


def windows(cfg, text_len_after_prompt, prompt_len):
    """(start, length) of the window at each step, by the rule of serve/window.py with limit N."""
    keep, start, out = keep_bytes(cfg.context, cfg.context), 0, []
    for length in range(prompt_len, prompt_len + text_len_after_prompt):
        start = window_start(start, length, cfg.context, keep)
        out.append((start, length))
    return out


def reference(m, prompt, n):
    """Greedy bytes of the whole model, uncached, on the window the rule gives at every step."""
    text = bytearray(prompt)
    for start, _ in windows(m.cfg, n, len(prompt)):
        with torch.no_grad():
            text.append(int(m(torch.tensor(list(text[start:]))[None])[0, -1].argmax()))
    return bytes(text[len(prompt):])


def stages(first):
    st = first
    while st is not None:
        yield st
        st = st.next


def run(first, cfg, prompt, *, draft=None, **kw):
    return list(generate_ar(first, cfg, GenerationRequest(prompt, **kw), draft=draft))


def test_split_layers():
    assert split_layers(6, 3) == [(0, 2), (2, 4), (4, 6)]
    assert split_layers(5, 2) == [(0, 2), (2, 5)]


def test_cached_chain_matches_the_whole_model_across_window_restarts(tiny_cfg):
    m = model(tiny_cfg)
    prompt = b"the cached chain"
    first = local_ar_chain(m, 3, CPU)
    got = run(first, tiny_cfg, prompt, n_bytes=60, seed=0, temperature=0.0, request_id="r")
    assert b"".join(r.new_bytes for r in got) == reference(m, prompt, 60)  # 16 + 60 > N = 32: two restarts
    assert all(r.route == ["ar-0-2", "ar-2-4", "ar-4-6"] for r in got) and len(got) == 60
    start, length = windows(tiny_cfg, 60, len(prompt))[-1]
    assert all(st.sessions["r"].length == length - start for st in stages(first))  # the cache kept growing


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
    got = run(first, tiny_cfg, b"spare me", n_bytes=12, seed=0, temperature=0.0)
    assert b"".join(r.new_bytes for r in got) == reference(m, b"spare me", 12)
    assert got[4].route[1] == "primary" and got[5].route[1] == "spare"


@pytest.mark.parametrize("temperature,draft_kind", [(0.0, "near"), (1.0, "near"), (1.0, "other")])
def test_speculative_decoding_is_bit_identical_to_plain_decoding(tiny_cfg, temperature, draft_kind):
    target = model(tiny_cfg, layers=3)
    draft = near_copy(target) if draft_kind == "near" else model(tiny_cfg, layers=1, seed=7)
    prompt, n = b"speculate", 70  # 9 + 70 > N = 32: the window restarts, inside would-be drafts too
    drafted = accepted = 0
    for seed in (0, 1, 2):
        plain_chain, spec_chain = local_ar_chain(target, 3, CPU), local_ar_chain(target, 3, CPU)
        plain = run(plain_chain, tiny_cfg, prompt, n_bytes=n, seed=seed, temperature=temperature, request_id="p")
        spec = run(spec_chain, tiny_cfg, prompt, n_bytes=n, seed=seed, temperature=temperature, request_id="s",
                   draft=ARDrafter(draft), draft_len=6)
        assert b"".join(r.new_bytes for r in spec) == b"".join(r.new_bytes for r in plain)
        assert len(plain) == n and 1 < n / len(spec) <= 7  # drafts paid, and never more than G + 1 per traversal
        drafted += sum(r.drafted for r in spec)
        accepted += sum(len(r.new_bytes) - 1 for r in spec)
        # stronger than equal bytes: every cached key and value of the final window is the same bits
        for a, b in zip(stages(plain_chain), stages(spec_chain)):
            pa, sb = a.sessions["p"], b.sessions["s"]
            assert sb.length >= pa.length and sb.tokens[:pa.length] == pa.tokens
            for (ka, va), (kb, vb) in zip(pa.kv, sb.kv):
                assert torch.equal(ka, kb[:, :, :pa.length]) and torch.equal(va, vb[:, :, :pa.length])
    assert drafted > accepted > 0  # both branches ran: drafts kept and drafts replaced


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_target_as_its_own_draft_has_every_proposal_accepted(tiny_cfg, temperature):
    target = model(tiny_cfg, layers=3, seed=3)
    prompt, n, g = b"perfect", 70, 5
    spec = run(local_ar_chain(target, 3, CPU), tiny_cfg, prompt, n_bytes=n, seed=4, temperature=temperature,
               draft=ARDrafter(copy.deepcopy(target)), draft_len=g)
    plain = run(local_ar_chain(target, 3, CPU), tiny_cfg, prompt, n_bytes=n, seed=4, temperature=temperature)
    assert b"".join(r.new_bytes for r in spec) == b"".join(r.new_bytes for r in plain)
    # each traversal commits its whole draft plus one: G + 1 bytes, unless cut by a restart or the end
    expected, length, start, keep = [], len(prompt), 0, keep_bytes(tiny_cfg.context, tiny_cfg.context)
    while length < len(prompt) + n:
        start = window_start(start, length, tiny_cfg.context, keep)
        cut = min(g, tiny_cfg.context - (length - start), len(prompt) + n - length - 1)
        expected.append(cut + 1)
        length += cut + 1
    assert [len(r.new_bytes) for r in spec] == expected
    assert [r.drafted for r in spec] == [e - 1 for e in expected]
    assert sum(expected) / len(expected) > 4  # G = 5: most traversals commit six bytes


def test_a_state_inside_the_cache_rewinds_it_and_one_past_it_is_a_cache_miss(tiny_cfg):
    m = model(tiny_cfg, seed=2)
    d = tiny_cfg.d_model
    torch.manual_seed(0)
    rows = torch.randn(12, d)
    tokens = bytes(range(65, 77))

    def state(start, n, draft=b""):
        return ARState(request_id="r", tokens=tokens[:start + n - len(draft)], step=0, seed=0, temperature=0.0,
                       start=start, hidden=rows[start:start + n], draft=draft)

    mid = LocalARStage(m, 2, 4, next=LocalARStage(m, 4, 6))
    mid._local(state(0, 10, draft=b"ABCD"))  # 6 known rows and 4 verify rows
    assert mid.sessions["r"].length == 10
    after = mid._local(state(7, 3))  # rejected from row 7 on: rewind to 7, then 3 new rows
    assert mid.sessions["r"].length == 10
    fresh = LocalARStage(m, 2, 4, next=LocalARStage(m, 4, 6))
    fresh._local(state(0, 7, draft=b"A"))  # the same 7 rows, grouped as above: 6 in a batch, then 1
    again = fresh._local(state(7, 3))
    assert torch.equal(after.hidden, again.hidden)  # the rewound cache is the cache of the kept rows
    for (ka, va), (kb, vb) in zip(mid.sessions["r"].kv, fresh.sessions["r"].kv):
        assert torch.equal(ka, kb) and torch.equal(va, vb)
    with pytest.raises(CacheMiss, match="holds 10 positions"):
        mid._local(ARState(request_id="r", tokens=tokens, step=0, seed=0, temperature=0.0, start=11,
                           hidden=rows[11:12]))


def test_a_first_stage_rewinds_to_the_common_prefix_of_its_window(tiny_cfg):
    m = model(tiny_cfg, seed=2)
    first = local_ar_chain(m, 2, CPU)
    r = first.forward(ARState(request_id="r", tokens=b"hello", step=0, seed=0, temperature=0.0, draft=b"xyz"))
    assert 1 <= len(r.new_bytes) <= 4
    assert first.sessions["r"].tokens == b"helloxyz"
    nxt = first._local(ARState(request_id="r", tokens=b"helloxQ", step=2, seed=0, temperature=0.0))
    assert nxt.start == 6 and nxt.hidden.shape[0] == 1  # rows "hellox" reused, only "Q" is new
    assert first.sessions["r"].tokens == b"helloxQ"


def test_kv_caches_stay_within_their_budget_under_a_flood_of_request_ids(tiny_cfg):
    m = model(tiny_cfg, layers=2, seed=4)
    full = 2 * 1 * tiny_cfg.context * tiny_cfg.d_model * 4  # one layer per stage, N positions, float32
    last = LocalARStage(m, 1, 2, kv_bytes=3 * full)
    first = LocalARStage(m, 0, 1, next=last, kv_bytes=3 * full)
    drafter = ARDrafter(model(tiny_cfg, layers=1, seed=5), kv_bytes=2 * full * 1, max_sessions=4)
    for i in range(60):  # hostile ids, each a full window (20 times what the budget holds)
        rid = f"flood-{i}"
        first.forward(ARState(request_id=rid, tokens=bytes([i % 256]) * 24, step=0, seed=0, temperature=0.0,
                              draft=drafter.propose(rid, b"x" * 24, 8, step=0, seed=0, temperature=0.0)))
        assert first.sessions.nbytes <= 3 * full and len(first.sessions) == min(i + 1, 3)
        assert last.sessions.nbytes <= 3 * full and len(last.sessions) <= 4  # ≥ 24 of 32 rows each
        assert drafter.sessions.nbytes <= 2 * full and len(drafter.sessions) <= 2
    counted = LocalARStage(m, 0, 2, max_sessions=5)  # the count bound holds with room in the byte budget
    for i in range(50):
        counted.forward(ARState(request_id=f"c{i}", tokens=b"ab", step=0, seed=0, temperature=0.0))
    assert len(counted.sessions) == 5
    # a request evicted from the last stage mid-way is still served right: its next state misses
    # there and the first stage resends the window
    out = bytearray()
    for i, r in enumerate(generate_ar(first, tiny_cfg, GenerationRequest(b"flood", n_bytes=10, seed=0, temperature=0.0,
                                                                         request_id="victim"))):
        out += r.new_bytes
        for j in range(4):
            last.forward(ARState(request_id=f"push-{i}-{j}", tokens=b"p" * 32, step=0, seed=0, temperature=0.0,
                                 hidden=torch.zeros(32, tiny_cfg.d_model)))
        assert "victim" not in last.sessions and "victim" in first.sessions
    assert bytes(out) == reference(m, b"flood", 10)
    with pytest.raises(ConfigError, match="cannot hold one full session"):
        LocalARStage(m, 0, 2, kv_bytes=full)


def test_draft_lengths_states_and_verdicts_are_checked(tiny_cfg):
    m = model(tiny_cfg, layers=2)
    first = local_ar_chain(m, 2, CPU)
    drafter = ARDrafter(model(tiny_cfg, layers=1))
    assert max_draft(tiny_cfg) == 15  # G < N/2 = 16
    for g in (-1, 16, 33):
        with pytest.raises(InputError, match=f"draft length G={g} is out of range"):
            run(first, tiny_cfg, b"hi", n_bytes=4, seed=0, temperature=0.0, draft=drafter, draft_len=g)
    with pytest.raises(InputError, match="temperature must be"):
        run(first, tiny_cfg, b"hi", n_bytes=4, seed=0, temperature=float("nan"), draft=drafter, draft_len=4)
    with pytest.raises(InputError, match="needs a draft model"):
        run(first, tiny_cfg, b"hi", n_bytes=4, seed=0, temperature=0.0, draft_len=4)
    with pytest.raises(InputError, match="does not fit"):  # straight to a stage: too long, or past N
        first.forward(ARState(request_id="r", tokens=b"hi", step=0, seed=0, temperature=0.0, draft=b"d" * 16))
    with pytest.raises(InputError, match="does not fit"):
        first.forward(ARState(request_id="r", tokens=b"h" * 30, step=0, seed=0, temperature=0.0, draft=b"ddd"))
    with pytest.raises(InputError, match="request id"):
        first.forward(ARState(request_id="r" * 129, tokens=b"hi", step=0, seed=0, temperature=0.0))
    mid = LocalARStage(m, 1, 2)
    d = tiny_cfg.d_model
    bad = [dict(hidden=torch.zeros(3, 7)), dict(hidden=torch.full((2, d), float("nan"))), dict(hidden=None),
           dict(hidden=torch.zeros(2, d), draft=b"xy", start=2),  # verify rows without a known row before them
           dict(hidden=torch.zeros(5, d), draft=b"xy"),  # more rows than context + draft
           dict(hidden=torch.zeros(2, d), draft=b"x", start=1, reset=True),
           dict(hidden=torch.full((3, d), float("inf")), draft=b"x")]
    for kw in bad:
        with pytest.raises(MalformedInput):
            mid.forward(ARState(request_id="r", tokens=b"ab", step=0, seed=0, temperature=0.0, **kw))
    assert len(mid.forward(ARState(request_id="r", tokens=b"ab", step=0, seed=0, temperature=0.0,
                                   hidden=torch.zeros(3, d), draft=b"x")).new_bytes) in (1, 2)

    class Liar:  # a chain that answers bytes no verification can give
        name = "liar"

        def __init__(self, reply):
            self.reply = reply

        def forward(self, state):
            return SegmentResult(new_bytes=self.reply(state.draft))

    # nothing; more than G + 1; a wrong "accepted" byte; a "replacement" equal to the draft byte
    for reply in (lambda d: b"", lambda d: d + b"zz", lambda d: bytes([d[0] ^ 1]) + d, lambda d: d[:3]):
        with pytest.raises(MalformedInput, match="not an accepted prefix"):
            run(Liar(reply), tiny_cfg, b"hi", n_bytes=20, seed=0, temperature=0.0, draft=drafter, draft_len=4)
    with pytest.raises(ConfigError, match="context 16"):
        LocalARStage(m, 0, 2, drafter=ARDrafter(ByteTransformer(ModelConfig(
            d_model=32, n_heads=2, n_layers=1, n_blocks=3, context=16, segments=(1, 8)), 1)))
    with pytest.raises(ConfigError, match="only the first stage"):
        LocalARStage(m, 1, 2, drafter=drafter)


def test_concurrent_requests_share_batched_traversals_and_get_what_they_get_alone(tiny_cfg):
    """Continuous batching of the AR chain: six requests (greedy and sampled, windows restarting at
    different steps, one speculative) driven at once through the entry's BatchingStage share
    traversals, and each gets the bytes it gets alone; the batched rows equal one-row extends."""
    import threading

    from btnode.serve.batching import BatchingStage
    from btnode.serve.kvcache import KVSession, extend, extend_each

    m = model(tiny_cfg)
    layers = m.layers[:2]
    a, b, a2, b2 = (KVSession(2) for _ in range(4))
    with torch.no_grad():
        for s, n in ((a, 5), (a2, 5), (b, 9), (b2, 9)):
            torch.manual_seed(n)
            extend(layers, s, torch.randn(n, 32))
    rows = torch.randn(2, 32)
    with torch.no_grad():
        both = extend_each(layers, [a, b], rows)
        assert torch.allclose(both[0], extend(layers, a2, rows[:1])[0], atol=1e-5)
        assert torch.allclose(both[1], extend(layers, b2, rows[1:])[0], atol=1e-5)
    assert (a.length, b.length) == (6, 10) and all(torch.allclose(x, y, atol=1e-5) for p, q in zip(b.kv, b2.kv)
                                                   for x, y in zip(p, q))

    draft = ARDrafter(near_copy(m), device=CPU)
    asks = [dict(prompt=p, n_bytes=n, seed=i, temperature=t, draft_len=g, request_id=f"r{i}")
            for i, (p, n, t, g) in enumerate([(b"one", 40, 0.0, 0), (b"a longer prompt", 30, 1.0, 0), (b"x", 24, 1.0, 0),
                                              (b"y" * 20, 20, 0.0, 0), (b"mid", 30, 1.0, 3), (b"It", 36, 0.7, 0)])]
    alone = [b"".join(r.new_bytes for r in run(local_ar_chain(m, 3, CPU, drafter=draft), tiny_cfg,
                                                    draft=draft if k["draft_len"] else None, **k)) for k in asks]
    entry = BatchingStage(local_ar_chain(m, 3, CPU, drafter=draft), chain="ar", gather_s=0.05)
    got: dict[int, bytes] = {}

    def go(i):
        k = asks[i]
        got[i] = b"".join(r.new_bytes for r in run(entry, tiny_cfg, draft=draft if k["draft_len"] else None, **k))

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(asks))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert [got.get(i) for i in range(len(asks))] == alone
    stats = entry.stats()
    assert stats["mean_batch"] > 2 and stats["largest"] >= 4, stats  # they did share traversals
