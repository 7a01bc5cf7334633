"""Offline data for the reference models, all token ids (vocab 256), seeded by strings so every stream is the same
on every machine: associative recall in noise, a shared-vocabulary variant, and key-value needles in text. The
question comes *after* the context, so the pipeline can compress the context first.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from kvzoo.haystacks import haystack_sentences

VOCAB_SIZE = 256
PAD, BOS, QUERY, NEEDLE = 0, 1, 2, 3
KEYS = tuple(range(4, 68))  # 64 key symbols
VALUES = tuple(range(68, 132))  # 64 value symbols
NOISE = tuple(range(132, 256))  # 124 filler symbols
SHARED = tuple(range(4, 256))  # the harder variant: keys, values and filler share one vocabulary
IGNORE = -100

# Curriculum (docs/environment.md): start short with few pairs, advance at >= 95 % held-out accuracy.
CURRICULUM: tuple[tuple[int, int], ...] = ((64, 4), (64, 8), (128, 8), (256, 8), (256, 16), (512, 16))
TASKS = ("recall", "shared", "needle_text")


@dataclass
class Example:
    """One held-out example: ``context`` and ``question`` ids, the ``answer`` id."""

    context: list[int]
    question: list[int]
    answer: int

    def as_dict(self) -> dict:
        return {"context": self.context, "question": self.question, "answer": self.answer}


def _pair_positions(rng: random.Random, body_len: int, n_pairs: int) -> list[int]:
    """Sorted start positions of ``n_pairs`` non-overlapping 2-token pairs in a body of ``body_len``."""
    starts = sorted(rng.sample(range(body_len - n_pairs), n_pairs))
    return [p + i for i, p in enumerate(starts)]  # each earlier pair shifts later ones by one


def recall_context(
    rng: random.Random, context_len: int, n_pairs: int, shared: bool = False
) -> tuple[list[int], list[int], list[int]]:
    """``(context, keys, values)``: BOS + noise with ``n_pairs`` key-value pairs scattered in it; ``shared=True`` (harder)
    draws keys, values and noise from one symbol set (keys still distinct and nowhere else), else three disjoint ones."""
    body_len = context_len - 1
    if shared:
        keys = rng.sample(SHARED, n_pairs)
        values = [rng.choice(SHARED) for _ in range(n_pairs)]
        key_set = set(keys)
        filler = [t for t in SHARED if t not in key_set]
    else:
        keys = rng.sample(KEYS, n_pairs)
        values = [rng.choice(VALUES) for _ in range(n_pairs)]
        filler = NOISE
    body = [rng.choice(filler) for _ in range(body_len)]
    for pos, k, v in zip(_pair_positions(rng, body_len, n_pairs), keys, values, strict=True):
        body[pos], body[pos + 1] = k, v
    return [BOS, *body], keys, values


def recall_example(rng: random.Random, length: int, n_pairs: int, shared: bool = False) -> Example:
    """A held-out example whose full input (context + question) is ``length`` tokens."""
    context, keys, values = recall_context(rng, length - 2, n_pairs, shared)
    i = rng.randrange(n_pairs)
    return Example(context, [QUERY, keys[i]], values[i])


def training_batch(
    seed: int, step: int, length: int, n_pairs: int, batch_size: int, n_queries: int | None = None,
    shared: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, labels)`` ``[B, length]`` for one step; labels are IGNORE except answer tokens. ``n_queries``
    questions per sequence (default ``min(16, length // 8)``): dense supervision, as in Zoology's MQAR."""
    rng = random.Random(f"train-{seed}-{step}-{length}-{n_pairs}-{shared}")
    n_queries = n_queries or min(16, length // 8)
    ids, labels = [], []
    for _ in range(batch_size):
        context, queries, answers = _with_queries(rng, length, n_pairs, n_queries, shared)
        label = [IGNORE] * (len(context) + len(queries))
        for i in answers:
            label[len(context) + i] = queries[i]
        ids.append(context + queries)
        labels.append(label)
    return torch.tensor(ids), torch.tensor(labels)


def _with_queries(rng: random.Random, length: int, n_pairs: int, n_queries: int,
                  shared: bool = False) -> tuple[list[int], list[int], list[int]]:
    """A recall context of ``length - 3 * n_queries`` tokens, its ``[QUERY k v] * n_queries`` questions and answers
    (distinct keys when there are enough pairs, else drawn with replacement), and the answers' positions in those."""
    context, keys, values = recall_context(rng, length - 3 * n_queries, n_pairs, shared)
    order = rng.sample(range(n_pairs), n_queries) if n_queries <= n_pairs else [
        rng.randrange(n_pairs) for _ in range(n_queries)]
    queries = [token for i in order for token in (QUERY, keys[i], values[i])]
    return context, queries, list(range(2, len(queries), 3))


def heldout_recall(length: int, n_pairs: int, count: int = 200, shared: bool = False, seed: int = 12345) -> list[Example]:
    """Fixed held-out recall set (seed independent of every training seed's stream)."""
    rng = random.Random(f"heldout-{seed}-{length}-{n_pairs}-{shared}")
    return [recall_example(rng, length, n_pairs, shared) for _ in range(count)]


@dataclass
class ContinuationExample:
    """A held-out recall context and its continuation in the training layout, ``[QUERY k v] * n_queries``:
    ``scored`` are the continuation's answer positions (the ``v`` tokens, what the twins were trained to predict;
    the markers and the keys asked are chance by design)."""

    context: list[int]
    continuation: list[int]
    scored: list[int]


def heldout_recall_continuation(length: int = 512, n_pairs: int = 16, n_queries: int = 16, count: int = 100,
                                seed: int = 12345) -> list[ContinuationExample]:
    """Held-out sequences of the twins' own distribution for ΔCE: what :func:`training_batch` builds (a context of
    ``length - 3 * n_queries`` tokens, then ``n_queries`` questions with their answers, distinct keys), from a
    stream no training run draws (seeded by ``seed``, not by a training seed)."""
    rng = random.Random(f"heldout-continuation-{seed}-{length}-{n_pairs}-{n_queries}")
    return [ContinuationExample(*_with_queries(rng, length, n_pairs, n_queries)) for _ in range(count)]


# --- RULER-style needles in text --------------------------------------------------------------
# Characters of the haystack map onto the noise symbols (lower-cased; anything else -> one symbol),
# so the text never contains a key, a value or a marker. A needle is [NEEDLE, k, v] between words.
_CHARS = "abcdefghijklmnopqrstuvwxyz .,;:'!?-\"()0123456789"
CHAR_IDS = {ch: NOISE[i] for i, ch in enumerate(_CHARS)}
_OTHER_CHAR = NOISE[len(_CHARS)]


def text_ids(text: str) -> list[int]:
    return [CHAR_IDS.get(ch, _OTHER_CHAR) for ch in text.lower()]


def needle_text_example(rng: random.Random, length: int, n_needles: int, haystack: str = "book") -> Example:
    """RULER multi-key NIAH on character-level text from :mod:`kvzoo.haystacks` (``length`` in all)."""
    context_len = length - 2
    body_len = context_len - 1 - 3 * n_needles
    sentences = haystack_sentences(haystack, seed=rng.randrange(1 << 30))
    body: list[int] = []
    while len(body) < body_len:
        body += text_ids(next(sentences) + " ")
    body = body[:body_len]
    word_starts = [i for i in range(1, body_len) if body[i - 1] == CHAR_IDS[" "]] or list(range(body_len))
    cuts = sorted(rng.sample(word_starts, n_needles)) if len(word_starts) >= n_needles else sorted(
        rng.sample(range(body_len), n_needles))
    keys = rng.sample(KEYS, n_needles)
    values = [rng.choice(VALUES) for _ in range(n_needles)]
    out, prev = [BOS], 0
    for cut, k, v in zip(cuts, keys, values, strict=True):
        out += body[prev:cut] + [NEEDLE, k, v]
        prev = cut
    out += body[prev:]
    i = rng.randrange(n_needles)
    return Example(out, [QUERY, keys[i]], values[i])


def heldout_needle_text(length: int, n_needles: int, count: int = 200, haystack: str = "book", seed: int = 12345) -> list[Example]:
    rng = random.Random(f"needle-{seed}-{length}-{n_needles}-{haystack}")
    return [needle_text_example(rng, length, n_needles, haystack) for _ in range(count)]


def heldout(task: str, length: int, n_pairs: int, count: int = 200, seed: int = 12345) -> list[Example]:
    """Held-out set by task name: ``"recall"``, ``"shared"`` or ``"needle_text"``."""
    if task == "recall":
        return heldout_recall(length, n_pairs, count, shared=False, seed=seed)
    if task == "shared":
        return heldout_recall(length, n_pairs, count, shared=True, seed=seed)
    if task == "needle_text":
        return heldout_needle_text(length, n_pairs, count, seed=seed)
    raise ValueError(f"unknown task {task!r}; valid: {TASKS}")
