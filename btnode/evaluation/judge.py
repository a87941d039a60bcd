"""The judge of generated text (issue #11): the fixed prompts over the held-out file with their real
continuations, judge CE (nats/byte of a continuation given its prompt under a larger AR byte model,
never served and never tuned against), and form metrics (distinct 4-grams, repeats, English words)."""

from __future__ import annotations

import string
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from btnode.data.source import ByteSource, as_source
from btnode.errors import DataError, InputError
from btnode.model.ar import ByteTransformer

PROMPT_BYTES = 64  # bytes of each fixed prompt
CONTINUATION_BYTES = 256  # bytes of each real (reference) continuation; generate at least this many
N_PROMPTS = 32
REPEAT_SPAN = 16  # repeat fraction: bytes inside a 16-byte substring seen earlier in the continuation
WORDS_PATH = Path("/usr/share/dict/american-english")  # Debian's wamerican (`make tools` installs it)
FALLBACK_MIN_COUNT = 3
_CAPITALS = frozenset(string.ascii_uppercase.encode())
_PUNCTUATION = string.punctuation + "“”‘’«»…–—\ufffd"


# --- the fixed prompts --------------------------------------------------------------------------

@dataclass(frozen=True)
class Prompt:
    index: int
    offset: int  # where the prompt starts in the held-out file
    prompt: bytes  # PROMPT_BYTES bytes
    reference: bytes  # the CONTINUATION_BYTES bytes that really follow it


SCAN_BYTES = 1 << 20  # a prompt's sentence start is searched for in reads of this size, never a whole split


def _sentence_start_in(data: bytes, lo: int, hi: int) -> int | None:
    """First p in [lo, hi) where a sentence starts (". " then a capital) and the next PROMPT_BYTES
    bytes hold no newline, so that the prompt is prose from one paragraph (not a heading)."""
    p = data.find(b". ", max(lo - 2, 0))
    while 0 <= p and p + 2 < hi:
        s = p + 2
        if s >= lo and data[s] in _CAPITALS and b"\n" not in data[s:s + PROMPT_BYTES]:
            return s
        p = data.find(b". ", p + 1)
    return None


def _sentence_start(test: ByteSource, lo: int, hi: int) -> int | None:
    """`_sentence_start_in` over the stream, read SCAN_BYTES at a time (each read starts 2 bytes early
    for the ". " and runs PROMPT_BYTES late for the newline test), so a large split is never held."""
    for a in range(lo, hi, SCAN_BYTES):
        b, base = min(a + SCAN_BYTES, hi), max(a - 2, 0)
        found = _sentence_start_in(test.read(base, b + PROMPT_BYTES - base), a - base, b - base)
        if found is not None:
            return base + found
    return None


def fixed_prompts(data: ByteSource | bytes, n: int = N_PROMPTS) -> list[Prompt]:
    """The n fixed prompts over the held-out split (wiki.test.raw by default), no randomness.

    The usable span [0, len − 320) is cut into n equal slices; prompt i starts at the first sentence
    start in slice i (a capital letter after ". ", with no newline in the next 64 bytes), or at the
    slice's first byte if it has none (never the case for wiki.test.raw). Each prompt is the 64 bytes
    from there and its reference the 256 bytes after them, so prompts never overlap one another."""
    test = as_source(data, "held-out file")
    span = PROMPT_BYTES + CONTINUATION_BYTES
    usable = len(test) - span
    if n < 1 or usable < n * span:
        raise DataError(f"{test.description} has {len(test)} bytes, too short for {n} prompts of {span} bytes")
    out = []
    for i in range(n):
        lo, hi = i * usable // n, (i + 1) * usable // n
        start = _sentence_start(test, lo, hi)
        start = lo if start is None else start
        text = test.read(start, span)
        out.append(Prompt(i, start, text[:PROMPT_BYTES], text[PROMPT_BYTES:]))
    return out


# --- form metrics (pure functions of one continuation) ------------------------------------------

def distinct4(text: bytes) -> float:
    """Distinct byte 4-grams / all byte 4-grams (overlapping); 0 for fewer than 4 bytes."""
    grams = [text[i:i + 4] for i in range(len(text) - 3)]
    return len(set(grams)) / len(grams) if grams else 0.0


def repeat_fraction(text: bytes, span: int = REPEAT_SPAN) -> float:
    """Fraction of bytes lying inside some `span`-byte substring that already started at an earlier
    position of the same text (the earlier occurrence may overlap it); 0 for an empty text."""
    if not text:
        return 0.0
    first: dict[bytes, int] = {}
    covered = [0] * (len(text) + 1)  # difference array of covered ranges
    for i in range(len(text) - span + 1):
        gram = text[i:i + span]
        if gram in first:
            covered[i] += 1
            covered[i + span] -= 1
        else:
            first[gram] = i
    depth, inside = 0, 0
    for c in covered[:-1]:
        depth += c
        inside += depth > 0
    return inside / len(text)


def words_of(text: bytes) -> list[str]:
    """Whitespace-separated words, UTF-8 decoded (bad bytes become U+FFFD), surrounding punctuation
    stripped, lower-cased; tokens that are punctuation only (WikiText's "," and "@-@") are dropped."""
    out = []
    for token in text.decode("utf-8", errors="replace").split():
        word = token.strip(_PUNCTUATION).lower()
        if word:
            out.append(word)
    return out


@dataclass(frozen=True)
class WordList:
    words: frozenset[str]  # lower-case
    source: str  # which list: recorded in every result


def english_words(path: Path = WORDS_PATH, fallback_corpus: bytes | None = None) -> WordList:
    """Debian's wamerican list at `path`, lower-cased. Fallback when it is absent: the words (as
    `words_of` cuts them) occurring ≥ 3 times in `fallback_corpus`, by default the training split of
    the bundled corpus; `source` says which list it is."""
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").split()
        label = "wamerican, " if path == WORDS_PATH else ""
        return WordList(frozenset(w.lower() for w in lines), f"{path} ({label}{len(lines)} entries)")
    except OSError:
        pass
    if fallback_corpus is None:
        from btnode.data import corpus

        train = corpus.bundled().train
        fallback_corpus = train.read(0, len(train))
    counts = Counter(words_of(fallback_corpus))
    words = frozenset(w for w, c in counts.items() if c >= FALLBACK_MIN_COUNT)
    return WordList(words, f"fallback: {path} absent; the {len(words)} words occurring ≥ {FALLBACK_MIN_COUNT} "
                           "times in the bundled training split (wiki.valid.raw without its last 64 KiB)")


ONE_LETTER_WORDS = frozenset({"a", "i"})


def word_rate(text: bytes, words: WordList) -> float:
    """Share of the text's words (see `words_of`) found in the word list; 0 when it has none.
    wamerican lists every letter of the alphabet as a word, so a one-letter word counts only if it
    is "a" or "I": otherwise noise such as "t e  t io e" would score as English."""
    ws = words_of(text)
    return sum(w in words.words and (len(w) > 1 or w in ONE_LETTER_WORDS) for w in ws) / len(ws) if ws else 0.0


# --- judge CE -----------------------------------------------------------------------------------

def judge_windows(n_prompt: int, length: int, context: int, stride: int) -> list[tuple[int, int, int]]:
    """Strided sliding windows scoring every byte t ∈ [n_prompt, length) of prompt + continuation
    once: (s, e, lo) feeds bytes [s, e) and scores targets [lo, e], so target t sees text[s:t].
    Each window after the first advances by `stride` and starts `context` bytes before its end, so
    every target sees ≥ context − stride + 1 preceding bytes, or all of them when fewer exist."""
    assert 1 <= n_prompt < length and 1 <= stride <= context, (n_prompt, length, stride, context)
    out, nxt = [], n_prompt
    while nxt < length:
        e = min(length - 1, max(nxt - 1 + stride, context))
        s = max(0, e - context)
        out.append((s, e, nxt))
        nxt = e + 1
    return out


@torch.no_grad()
def judge_nats(judge: ByteTransformer, pairs: Sequence[tuple[bytes, bytes]], *, stride: int | None = None,
               device: torch.device = torch.device("cpu"), batch: int = 64) -> list[float]:
    """Total nats of each continuation given its prompt under `judge` (teacher-forced, every byte
    scored once with the windows of `judge_windows`; stride defaults to half the judge's context)."""
    n = judge.cfg.context
    stride = n // 2 if stride is None else stride
    if not 1 <= stride <= n:
        raise InputError(f"stride must be in [1, {n}] (the judge's context), got {stride}")
    jobs: dict[int, list[tuple[int, torch.Tensor, int]]] = {}  # input length → (sample, bytes, first scored row)
    for i, (prompt, cont) in enumerate(pairs):
        if not prompt or not cont:
            raise InputError(f"sample {i} has an empty {'prompt' if not prompt else 'continuation'}: "
                             "the judge scores ≥ 1 byte after ≥ 1 byte of prompt")
        text = prompt + cont
        for s, e, lo in judge_windows(len(prompt), len(text), n, stride):
            jobs.setdefault(e - s, []).append((i, torch.frombuffer(bytearray(text[s:e + 1]), dtype=torch.uint8),
                                               lo - s - 1))
    judge.eval()
    nats = [0.0] * len(pairs)
    for group in jobs.values():
        for at in range(0, len(group), batch):
            part = group[at:at + batch]
            w = torch.stack([b for _, b, _ in part]).long().to(device)  # (W, T+1)
            nll = F.cross_entropy(judge(w[:, :-1]).double().transpose(1, 2), w[:, 1:], reduction="none").cpu()
            for (i, _, first), row in zip(part, nll):
                nats[i] += float(row[first:].sum())
    return nats


# --- scoring a set of samples -------------------------------------------------------------------

@dataclass(frozen=True)
class SampleScore:
    judge_ce: float  # nats/byte of this continuation
    n_bytes: int
    distinct4: float
    repeat_frac: float
    word_rate: float


@dataclass(frozen=True)
class JudgeReport:
    judge_ce: float  # nats/byte over all continuation bytes (byte-weighted)
    distinct4: float  # the form metrics: means over samples
    repeat_frac: float
    word_rate: float
    n_samples: int
    n_bytes: int
    stride: int
    word_list: str
    samples: tuple[SampleScore, ...]

    def to_dict(self, per_sample: bool = True) -> dict:
        d = asdict(self)
        d["samples"] = [asdict(s) for s in self.samples] if per_sample else None
        return d


def score_samples(judge: ByteTransformer, pairs: Sequence[tuple[bytes, bytes]], *, words: WordList,
                  stride: int | None = None, device: torch.device = torch.device("cpu")) -> JudgeReport:
    """Judge CE and form of each (prompt, continuation), and their means."""
    if not pairs:
        raise InputError("no samples to judge")
    stride = judge.cfg.context // 2 if stride is None else stride
    nats = judge_nats(judge, pairs, stride=stride, device=device)
    samples = tuple(SampleScore(judge_ce=t / len(c), n_bytes=len(c), distinct4=distinct4(c),
                                repeat_frac=repeat_fraction(c), word_rate=word_rate(c, words))
                    for t, (_, c) in zip(nats, pairs))
    total = sum(s.n_bytes for s in samples)
    return JudgeReport(judge_ce=sum(nats) / total, distinct4=_mean(s.distinct4 for s in samples),
                       repeat_frac=_mean(s.repeat_frac for s in samples), word_rate=_mean(s.word_rate for s in samples),
                       n_samples=len(samples), n_bytes=total, stride=stride, word_list=words.source, samples=samples)


def reference_pairs(prompts: Iterable[Prompt]) -> list[tuple[bytes, bytes]]:
    """The real continuations of the fixed prompts: the reference row every mode is read against."""
    return [(p.prompt, p.reference) for p in prompts]


def _mean(values: Iterable[float]) -> float:
    v = list(values)
    return sum(v) / len(v)
