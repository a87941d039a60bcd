"""The judge of generated text: form metrics on hand-made strings, the fixed prompt set, the strided
judge CE against a byte-by-byte reference, and the judge ordering real text < AR samples < shuffled."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from btnode.data import corpus
from btnode.data.windows import WindowSampler
from btnode.errors import DataError, InputError
from btnode.evaluation import judge as jd
from btnode.model.config import ModelConfig
from btnode.store.models import init_ar
from btnode.train.config import TrainConfig
from btnode.train.trainers import ARTrainer

WORDS = jd.WordList(frozenset({"the", "cat", "sat"}), "test list")
A = b"0123456789abcdef"  # 16 distinct bytes


@pytest.mark.parametrize("text, want", [(b"abcabc", 1.0), (b"aaaaaa", 1 / 3), (b"abcdabcd", 4 / 5), (b"abc", 0.0),
                                        (b"abcd", 1.0)])
def test_distinct4(text, want):
    assert jd.distinct4(text) == pytest.approx(want, abs=1e-12)


@pytest.mark.parametrize("text, want", [
    (A + A, 16 / 32),  # the second copy is one earlier 16-gram
    (A + b"XYZWVUTS" + A, 16 / 40),
    (b"a" * 40, 39 / 40),  # overlapping earlier occurrence: every byte after the first
    (A + b"XYZ" + A[:15], 0.0),  # 15 repeated bytes are not a 16-byte repeat
    (A[:10], 0.0), (b"", 0.0),
])
def test_repeat_fraction(text, want):
    assert jd.repeat_fraction(text) == pytest.approx(want, abs=1e-12)


def test_repeat_fraction_marks_exactly_the_repeated_bytes():
    text = A + b"#" + A[:4] + A + b"!"  # A reappears at 21…36; nothing else 16 bytes long repeats
    assert jd.repeat_fraction(text) == pytest.approx(16 / len(text))


@pytest.mark.parametrize("text, want", [
    (b"The cat , sat on the mat .", 4 / 6),  # "," and "." are not words
    (b'"Cat!" (the) @-@ dog', 2 / 3),
    (b" , . @-@ ", 0.0),  # no words at all
    (b"sat\nthe\tcat", 1.0),
    (b"the caf\xc3\xa9 \xff", 1 / 2),  # UTF-8 decoded; the lone \xff byte is punctuation-like U+FFFD, dropped
])
def test_word_rate(text, want):
    assert jd.word_rate(text, WORDS) == pytest.approx(want, abs=1e-12)


def test_one_letter_words_count_only_as_a_and_i():
    letters = jd.WordList(frozenset("abcdefghijklmnopqrstuvwxyz") | {"to"}, "every letter, as wamerican has")
    assert jd.word_rate(b"t e a I to", letters) == pytest.approx(3 / 5)


def test_word_list_file_and_fallback(tmp_path):
    (tmp_path / "words").write_text("Apple\nbanana\n")
    got = jd.english_words(tmp_path / "words")
    assert got.words == {"apple", "banana"} and str(tmp_path / "words") in got.source
    fb = jd.english_words(tmp_path / "absent", fallback_corpus=b"x y x y x y z z . ,")
    assert fb.words == {"x", "y"} and fb.source.startswith("fallback") and "absent" in fb.source


@pytest.fixture(scope="module")
def test_bytes() -> bytes:
    test = corpus.bundled().test
    return test.read(0, len(test))


def test_fixed_prompts_are_deterministic_and_spread(test_bytes):
    prompts = jd.fixed_prompts(test_bytes)
    assert prompts == jd.fixed_prompts(test_bytes) and len(prompts) == jd.N_PROMPTS >= 32
    usable = len(test_bytes) - 320
    for i, p in enumerate(prompts):
        assert p.index == i and i * usable // 32 <= p.offset < (i + 1) * usable // 32  # one per slice
        assert len(p.prompt) == 64 and len(p.reference) == 256
        assert p.prompt + p.reference == test_bytes[p.offset:p.offset + 320]
        # the stated rule: a sentence start, prose from one paragraph
        assert test_bytes[p.offset - 2:p.offset] == b". " and p.prompt[:1].isupper() and b"\n" not in p.prompt
    assert all(a.offset + 320 <= b.offset for a, b in zip(prompts, prompts[1:]))  # no overlaps
    assert prompts[-1].offset > 0.9 * len(test_bytes)
    assert len(jd.fixed_prompts(test_bytes, 64)) == 64
    with pytest.raises(DataError):
        jd.fixed_prompts(test_bytes[:5000])


def test_windows_score_every_byte_once_with_enough_context():
    for n_prompt, length, context, stride in [(64, 320, 128, 64), (5, 20, 32, 16), (1, 200, 16, 1), (3, 100, 16, 16)]:
        seen = []
        for s, e, lo in jd.judge_windows(n_prompt, length, context, stride):
            assert e - s <= context and s < lo <= e < length
            for t in range(lo, e + 1):
                assert t - s >= min(t, context - stride + 1)
            seen += range(lo, e + 1)
        assert seen == list(range(n_prompt, length))


def _bytewise_nats(model, prompt: bytes, cont: bytes) -> float:
    """Every continuation byte scored alone with the most context that fits: the stride-1 reference."""
    text, n = prompt + cont, model.cfg.context
    total = 0.0
    for t in range(len(prompt), len(text)):
        x = torch.tensor(list(text[max(0, t - n):t]))[None]
        total += F.cross_entropy(model(x)[0, -1:].double(), torch.tensor([text[t]])).item()
    return total


def test_judge_nats_matches_the_bytewise_reference():
    torch.manual_seed(0)
    model = init_ar(ModelConfig(d_model=32, n_heads=2, context=16, segments=(1,)), 1, 0).eval()
    pairs = [(b"The cat", b" sat on the mat and then some more."), (b"x" * 40, b"a"), (b"Q", b"0123456789")]
    with torch.no_grad():
        want = [_bytewise_nats(model, p, c) for p, c in pairs]
        assert jd.judge_nats(model, pairs, stride=1) == pytest.approx(want, rel=1e-9)
        strided = jd.judge_nats(model, pairs)  # stride 8: less context for some bytes, so close but not equal
    assert strided[1:] == pytest.approx(want[1:], rel=1e-9)  # one window: one byte, or prompt + continuation fit
    assert strided[0] != pytest.approx(want[0], rel=1e-9) and strided[0] == pytest.approx(want[0], rel=0.1)
    report = jd.score_samples(model, pairs, words=WORDS, stride=1)
    assert report.judge_ce == pytest.approx(sum(want) / sum(len(c) for _, c in pairs), rel=1e-9)
    assert report.samples[1].judge_ce == pytest.approx(want[1], rel=1e-9) and report.n_samples == 3
    assert report.distinct4 == pytest.approx(sum(jd.distinct4(c) for _, c in pairs) / 3)
    assert report.word_list == "test list" and report.stride == 1
    for bad in ([(b"", b"abc")], [(b"abc", b"")], []):
        with pytest.raises(InputError):
            jd.score_samples(model, bad, words=WORDS)
    with pytest.raises(InputError):
        jd.judge_nats(model, pairs, stride=17)


def _train(cfg: ModelConfig, n_layers: int, steps: int, data: bytes, lr: float):
    tc = TrainConfig(steps=steps, batch=16, lr=lr, warmup=10)
    tr = ARTrainer(init_ar(cfg, n_layers, 0), tc, torch.device("cpu"))
    sampler = WindowSampler(data, cfg.context)
    for step in range(steps):
        tr.train_step(sampler.batch(0, 0, step, tc.batch))
    return tr.model.eval()


@torch.no_grad()
def _sample(model, prompts: list[bytes], n_bytes: int, seed: int) -> list[bytes]:
    """Temperature-1 samples, all prompts in one batch (they have equal lengths)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.tensor([list(p) for p in prompts])
    for _ in range(n_bytes):
        probs = torch.softmax(model(x[:, -model.cfg.context:])[:, -1].double(), -1)
        x = torch.cat([x, torch.multinomial(probs, 1, generator=g)], 1)
    return [bytes(row[len(prompts[0]):].tolist()) for row in x]


def test_judge_orders_real_text_ar_samples_and_shuffled_bytes(test_bytes):
    data = corpus.bundled().train
    judge = _train(ModelConfig(d_model=64, n_heads=4, context=64, segments=(1,)), 2, 200, data, 3e-3)
    weak = _train(ModelConfig(d_model=32, n_heads=2, context=64, segments=(1,)), 1, 120, data, 3e-3)
    prompts = jd.fixed_prompts(test_bytes)
    real = jd.reference_pairs(prompts)
    g = torch.Generator().manual_seed(0)
    shuffled = [(p, bytes(torch.tensor(list(c))[torch.randperm(len(c), generator=g)].tolist())) for p, c in real]
    samples = list(zip([p for p, _ in real], _sample(weak, [p for p, _ in real], 256, seed=0)))
    words = jd.english_words()  # wamerican, or the stated fallback: either reads real text as words
    scores = {name: jd.score_samples(judge, pairs, words=words)
              for name, pairs in (("real", real), ("ar", samples), ("shuffled", shuffled))}
    ce = {name: r.judge_ce for name, r in scores.items()}
    assert ce["real"] + 0.1 < ce["ar"] < ce["shuffled"] - 0.1, ce
    # (seen: real 2.52, AR 3.03, shuffled 4.06 nats/byte; word rate 0.88, 0.37, 0.30)
    assert scores["real"].word_rate > scores["ar"].word_rate + 0.2, scores
