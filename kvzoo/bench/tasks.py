"""RULER-style tasks (Hsieh et al. 2024, https://arxiv.org/abs/2404.06654), generated offline: seeded, deterministic,
sized in tokens of the model's tokenizer, with RULER's templates, needles, answer prefixes and metric.

A prompt is split for the question-after-compression setting: ``context`` (prefilled and compressed), ``question``,
``answer_prefix``; ``continuation`` is the haystack text after the context (held out, for ΔCE). The context has
``context_tokens`` tokens to within 1 %, the queried needle starts at ``depth`` of the filler to within one sentence.
"""

from __future__ import annotations

import random
import string
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from kvzoo.haystacks import ALL_HAYSTACKS, filler_sentences, haystack_sentences, vocabulary

# --- task table ----------------------------------------------------------------------------------

TASKS: tuple[str, ...] = ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "vt", "cwe",
                          "niah_multiturn")
DEFAULT_HAYSTACK: dict[str, str] = {
    "niah_single": "essay", "niah_multikey": "essay", "niah_multivalue": "essay", "niah_multiquery": "essay",
    "vt": "noise", "cwe": "words", "niah_multiturn": "essay",
}
# tokens to generate after the answer prefix (RULER generates 128 / 30 / 120; these cover the
# answers of a small model and the runner stops as soon as every reference answer has appeared)
MAX_NEW_TOKENS: dict[str, int] = {
    "niah_single": 16, "niah_multikey": 16, "niah_multivalue": 48, "niah_multiquery": 48, "vt": 40, "cwe": 80,
    "niah_multiturn": 16,
}
NUM_NEEDLES = 4  # multikey: 1 queried + 3 distractors; multivalue: 4 values; multiquery: 4 keys; multiturn: 4 turns
VT_HOPS = 4  # variables in the chain: hops + 1
CWE_COMMON = 10  # words asked for
CWE_RARE_FREQ = 3  # occurrences of each uncommon word (RULER's freq_ucw)
CWE_COMMON_FREQ_MAX = 30  # RULER's freq_cw; fewer when the context is short (see _cwe)

_NIAH_INTRO = (
    "Some special magic numbers are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the numbers afterwards."
)
_NIAH_NEEDLE = "One of the special magic numbers for {key} is: {value}."
_NIAH_QUESTION = "What are all the special magic numbers for {query} mentioned in the provided text?"
_NIAH_ANSWER_PREFIX = "The special magic numbers for {query} mentioned in the provided text are:"
# niah_multiturn's facts: one template per turn (needle, question, answer prefix), so each question points at one fact
# -- with four needles of one template Gemma-3-270M, even with the full cache, answered 1 of 4 turns at 16k by listing
# the other needles' numbers; with these, 4 of 4 at 8k and 16k (docs/evaluation.md)
_TURN_INTRO = ("Some special facts are hidden within the following text. Make sure to memorize them. "
               "I will quiz you about them afterwards.")
_TURN_FACTS = (
    (_NIAH_NEEDLE, _NIAH_QUESTION, _NIAH_ANSWER_PREFIX),
    ("The secret passcode of the {key} vault is {value}.",
     "What is the secret passcode of the {query} vault mentioned in the provided text?",
     "The secret passcode of the {query} vault mentioned in the provided text is"),
    ("The phone number of the {key} bakery is {value}.",
     "What is the phone number of the {query} bakery mentioned in the provided text?",
     "The phone number of the {query} bakery mentioned in the provided text is"),
    ("The {key} expedition found {value} gold coins.",
     "How many gold coins did the {query} expedition find, according to the provided text?",
     "According to the provided text, the {query} expedition found"),
)
_VT_INTRO = "Memorize and track the chain(s) of variable assignment hidden in the following text."
_VT_QUESTION = "Question: Find all variables that are assigned the value {value} in the text above."
_VT_ANSWER_PREFIX = (
    "Answer: According to the chain(s) of variable assignment in the text above, {n} variables are "
    "assigned the value {value}, they are:"
)
_CWE_INTRO = (
    "Below is a numbered list of words. In these words, some appear more often than others. "
    "Memorize the ones that appear most often."
)
_CWE_QUESTION = "Question: What are the {n} most common words in the above list?"
_CWE_ANSWER_PREFIX = "Answer: The top {n} words that appear most often in the list are:"

# needle keys are RULER-style adjective-noun pairs
_KEY_ADJECTIVES = [
    "abundant", "brave", "calm", "dizzy", "eager", "fancy", "gentle", "hollow", "icy", "jolly", "keen",
    "lazy", "mellow", "nimble", "odd", "proud", "quick", "rustic", "shiny", "tidy", "vivid", "witty",
    "zealous", "amber", "breezy", "crisp", "dusty", "fuzzy", "grumpy", "humble",
]
_KEY_NOUNS = [
    "garage", "lantern", "otter", "pencil", "harbor", "violin", "meadow", "teapot", "falcon", "castle",
    "ribbon", "walnut", "glacier", "compass", "saddle", "pepper", "blanket", "orchid", "kettle", "tunnel",
    "beacon", "marble", "parrot", "quarry", "anchor", "thimble", "cactus", "ladder", "mitten", "spruce",
]


# --- tokenizers ----------------------------------------------------------------------------------


class ByteTokenizer:
    """UTF-8 bytes as token ids 0-255: a stand-in tokenizer for the tiny random models (the part of the transformers
    tokenizer interface kvzoo uses; no chat template, no special tokens)."""

    chat_template = None
    eos_token_id = None
    vocab_size = 256

    def __call__(self, text: str, add_special_tokens: bool = True, return_tensors: str | None = None) -> Any:
        ids = list(text.encode("utf-8"))
        if return_tensors == "pt":
            import torch

            return SimpleNamespace(input_ids=torch.tensor([ids], dtype=torch.long))
        if return_tensors is not None:
            raise ValueError(f"ByteTokenizer returns lists or torch tensors (return_tensors='pt'), not {return_tensors!r}")
        return SimpleNamespace(input_ids=ids)

    def decode(self, ids: Sequence[int] | Any, skip_special_tokens: bool = False) -> str:
        ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer()"


def count_tokens(tokenizer: Any, text: str) -> int:
    """Tokens of ``text`` without special tokens."""
    return len(tokenizer(text, add_special_tokens=False).input_ids)


# --- specs and instances -------------------------------------------------------------------------


@dataclass(frozen=True)
class TaskSpec:
    """What identifies one task instance: task, length in tokens, needle depth (a fraction in [0, 1]; None for ``cwe``,
    which has no needle), seed, haystack (None: the task's :data:`DEFAULT_HAYSTACK`)."""

    task: str = "niah_single"
    context_tokens: int = 2000
    depth: float | None = 0.5
    seed: int = 0
    haystack: str | None = None

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"unknown task {self.task!r}; valid tasks: {', '.join(TASKS)}")
        if isinstance(self.context_tokens, bool) or not isinstance(self.context_tokens, int) or self.context_tokens < 64:
            raise ValueError(f"context_tokens must be an int >= 64, got {self.context_tokens!r}")
        if self.task == "cwe":
            object.__setattr__(self, "depth", None)
        elif self.depth is None or not (0.0 <= float(self.depth) <= 1.0):
            raise ValueError(f"depth must be a fraction in [0, 1] for task {self.task!r}, got {self.depth!r}")
        else:
            object.__setattr__(self, "depth", float(self.depth))
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise TypeError(f"seed must be an int, got {self.seed!r}")
        haystack = self.haystack or DEFAULT_HAYSTACK[self.task]
        if self.task == "cwe":
            haystack = "words"
        elif haystack not in ALL_HAYSTACKS:
            raise ValueError(f"unknown haystack {haystack!r}; valid haystacks: {', '.join(ALL_HAYSTACKS)}")
        object.__setattr__(self, "haystack", haystack)

    @property
    def key(self) -> str:
        """A stable string id, e.g. ``niah_single/essay/2000/d0.50/s0`` (results files use it)."""
        depth = "-" if self.depth is None else f"{self.depth:.2f}"
        return f"{self.task}/{self.haystack}/{self.context_tokens}/d{depth}/s{self.seed}"

    def as_dict(self) -> dict[str, Any]:
        return {"task": self.task, "haystack": self.haystack, "context_tokens": self.context_tokens,
                "depth": self.depth, "seed": self.seed}


@dataclass(frozen=True)
class Turn:
    """One question of a multi-turn task, asked after the earlier turns' questions and answers (SCBench's shared
    context: one context compressed once, then questions about different facts in it, in sequence)."""

    question: str
    answer_prefix: str
    answers: tuple[str, ...]


@dataclass(frozen=True)
class Task:
    """One generated instance: the text pieces, the reference answers, and where the needles are."""

    spec: TaskSpec
    context: str  # prefilled and compressed: RULER's instruction, a newline, the haystack
    question: str  # asked after compression (or before, in the other column)
    answer_prefix: str  # the first words of the reply, fed before the model answers
    answers: tuple[str, ...]  # every one must appear in the output (string_match_all)
    metric: str
    continuation: str  # held-out text that continues the haystack
    max_new_tokens: int
    needles: tuple[str, ...] = ()  # inserted sentences, in text order
    context_token_count: int = 0  # tokens of ``context`` as built
    haystack_token_count: int = 0  # tokens of the haystack part (after the instruction), needles included
    needle_starts: tuple[int, ...] = ()  # per needle (text order): first token within the haystack part
    needle_token_counts: tuple[int, ...] = ()
    queried_needle: int | None = None  # index into ``needles`` of the needle placed at ``spec.depth``
    sentence_tokens: int = 0  # tokens of the longest haystack sentence used: the depth tolerance
    extra: dict[str, Any] = field(default_factory=dict)
    # multi-turn tasks: the questions after the first (``question``/``answers`` are the first turn's), each asked on
    # the same cache after the previous turn's question and the model's own answer
    later_turns: tuple[Turn, ...] = ()

    @property
    def answer_text(self) -> str:
        """The reference reply after ``answer_prefix`` (teacher-forced for ΔNLL): ``" a, b, c."``."""
        return " " + ", ".join(self.answers) + "."

    @property
    def needle_depth(self) -> float | None:
        """Where the queried needle starts, as a fraction of the haystack's filler tokens."""
        if self.queried_needle is None:
            return None
        i = self.queried_needle
        before = sum(self.needle_token_counts[:i])
        filler = self.haystack_token_count - sum(self.needle_token_counts)
        return max(0, self.needle_starts[i] - before) / max(1, filler)


# --- building blocks -----------------------------------------------------------------------------


def _take_words(tokenizer: Any, sentence: str, budget: int) -> tuple[str, str]:
    """The longest word prefix of ``sentence`` whose tokens (with a leading space) fit ``budget``; the rest."""
    words = sentence.split(" ")
    lo, hi = 0, len(words)  # largest k with count(words[:k]) <= budget
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if count_tokens(tokenizer, " " + " ".join(words[:mid])) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return " ".join(words[:lo]), " ".join(words[lo:])


def _continuation(tokenizer: Any, first: str, stream: Iterator[str], tokens: int) -> str:
    """``first`` and then whole sentences of ``stream`` up to about ``tokens`` tokens (none for ``tokens=0``)."""
    if tokens <= 0:
        return ""
    parts = [first] if first else []
    used = count_tokens(tokenizer, " " + first) if first else 0
    while used < tokens:
        sentence = next(stream)
        parts.append(sentence)
        used += count_tokens(tokenizer, " " + sentence)
    return " ".join(parts)


@dataclass
class _Assembled:
    context: str
    needle_starts: list[int]
    needle_counts: list[int]
    haystack_tokens: int
    sentence_tokens: int
    continuation: str
    order: list[int]  # insert indices in text order


def _assemble(
    tokenizer: Any,
    intro: str,
    stream: Iterator[str],
    inserts: list[tuple[float, str]],
    total_tokens: int,
    continuation_tokens: int,
) -> _Assembled:
    """``intro + "\\n" + haystack`` of ``total_tokens`` tokens with each ``(depth, sentence)`` inserted at the sentence
    boundary nearest ``depth`` of the filler (ties in list order); the text and where each insert starts."""
    n_intro = count_tokens(tokenizer, intro + "\n")
    insert_counts = [count_tokens(tokenizer, " " + s) for _, s in inserts]
    budget = total_tokens - n_intro - sum(insert_counts)
    if budget < 1:
        raise ValueError(
            f"context_tokens={total_tokens} is too short for this task: the instruction and needles alone take "
            f"{total_tokens - budget} tokens; use at least {total_tokens - budget + 32}"
        )
    filler: list[str] = []
    counts: list[int] = []
    used = 0
    rest = ""  # the words of the last sentence that did not fit: the continuation starts with them
    for sentence in stream:
        n = count_tokens(tokenizer, " " + sentence)
        if used + n > budget:
            head, rest = _take_words(tokenizer, sentence, budget - used)
            if head:
                filler.append(head)
                counts.append(count_tokens(tokenizer, " " + head))
            break
        filler.append(sentence)
        counts.append(n)
        used += n
    cumulative = [0]
    for n in counts:
        cumulative.append(cumulative[-1] + n)
    # boundary i = before filler sentence i; the nearest to each insert's depth
    placed: dict[int, list[int]] = {}
    for j, (depth, _) in enumerate(inserts):
        target = depth * cumulative[-1]
        boundary = min(range(len(cumulative)), key=lambda i: (abs(cumulative[i] - target), i))
        placed.setdefault(boundary, []).append(j)
    for js in placed.values():
        js.sort(key=lambda j: (inserts[j][0], j))
    items: list[tuple[str, int | None]] = []  # (text, insert index or None)
    for i in range(len(filler) + 1):
        items.extend((inserts[j][1], j) for j in placed.get(i, []))
        if i < len(filler):
            items.append((filler[i], None))
    haystack = " ".join(text for text, _ in items)
    starts: list[int] = []
    needle_counts: list[int] = []
    order: list[int] = []
    for k, (_, j) in enumerate(items):
        if j is not None:
            before = " ".join(t for t, _ in items[:k])
            starts.append(count_tokens(tokenizer, before) if before else 0)
            needle_counts.append(insert_counts[j])
            order.append(j)
    continuation = _continuation(tokenizer, rest, stream, continuation_tokens)
    return _Assembled(
        context=intro + "\n" + haystack,
        needle_starts=starts,
        needle_counts=needle_counts,
        haystack_tokens=count_tokens(tokenizer, haystack),
        sentence_tokens=max(counts, default=0),
        continuation=continuation,
        order=order,
    )


def _keys(rng: random.Random, n: int) -> list[str]:
    pairs = [f"{a}-{b}" for a in _KEY_ADJECTIVES for b in _KEY_NOUNS]
    return rng.sample(pairs, n)


def _values(rng: random.Random, n: int, digits: int = 7) -> list[str]:
    values: list[str] = []
    while len(values) < n:
        value = str(rng.randint(10 ** (digits - 1), 10**digits - 1))
        if value not in values:
            values.append(value)
    return values


def _join_query(keys: Sequence[str]) -> str:
    return keys[0] if len(keys) == 1 else ", ".join(keys[:-1]) + ", and " + keys[-1]


# --- the tasks -----------------------------------------------------------------------------------


def _niah(spec: TaskSpec, tokenizer: Any, continuation_tokens: int) -> Task:
    rng = random.Random(f"{spec.task}:{spec.seed}")
    n = 1 if spec.task == "niah_single" else NUM_NEEDLES
    if spec.task == "niah_multivalue":
        keys = _keys(rng, 1) * n
        values = _values(rng, n)
        query_keys = keys[:1]
        answers = values
    else:
        keys = _keys(rng, n)
        values = _values(rng, n)
        query_keys = keys if spec.task == "niah_multiquery" else keys[:1]
        answers = values if spec.task == "niah_multiquery" else values[:1]
    needles = [_NIAH_NEEDLE.format(key=k, value=v) for k, v in zip(keys, values)]
    depths = [spec.depth] + [rng.random() for _ in range(n - 1)]
    built = _assemble(
        tokenizer, _NIAH_INTRO, haystack_sentences(spec.haystack, spec.seed),
        list(zip(depths, needles)), spec.context_tokens, continuation_tokens,
    )
    query = _join_query(query_keys)
    first = Turn(_NIAH_QUESTION.format(query=query), _NIAH_ANSWER_PREFIX.format(query=query), tuple(answers))
    return _needle_task(spec, tokenizer, built, needles, first, {"keys": keys, "values": values})


def _needle_task(spec: TaskSpec, tokenizer: Any, built: _Assembled, needles: list[str], first: Turn,
                 extra: dict[str, Any], later_turns: tuple[Turn, ...] = ()) -> Task:
    """A needle task's :class:`Task` from its assembled context: ``first`` is the question asked (the first turn),
    ``needles[0]`` the one placed at ``spec.depth``."""
    order = built.order
    return Task(
        spec=spec,
        context=built.context,
        question=first.question,
        answer_prefix=first.answer_prefix,
        answers=first.answers,
        metric="string_match_all",
        continuation=built.continuation,
        max_new_tokens=MAX_NEW_TOKENS[spec.task],
        needles=tuple(needles[j] for j in order),
        context_token_count=count_tokens(tokenizer, built.context),
        haystack_token_count=built.haystack_tokens,
        needle_starts=tuple(built.needle_starts),
        needle_token_counts=tuple(built.needle_counts),
        queried_needle=order.index(0),
        sentence_tokens=built.sentence_tokens,
        extra=extra,
        later_turns=later_turns,
    )


def _vt(spec: TaskSpec, tokenizer: Any, continuation_tokens: int) -> Task:
    rng = random.Random(f"vt:{spec.seed}")
    names: list[str] = []
    while len(names) < VT_HOPS + 1:
        name = "".join(rng.choice(string.ascii_uppercase) for _ in range(5))
        if name not in names:
            names.append(name)
    value = _values(rng, 1, digits=5)[0]
    chain = [f"VAR {names[0]} = {value}."] + [f"VAR {names[i + 1]} = VAR {names[i]}." for i in range(VT_HOPS)]
    depths = [spec.depth + (1.0 - spec.depth) * i / (VT_HOPS + 1) for i in range(VT_HOPS + 1)]
    built = _assemble(
        tokenizer, _VT_INTRO, haystack_sentences(spec.haystack, spec.seed),
        list(zip(depths, chain)), spec.context_tokens, continuation_tokens,
    )
    first = Turn(_VT_QUESTION.format(value=value), _VT_ANSWER_PREFIX.format(n=len(names), value=value), tuple(names))
    return _needle_task(spec, tokenizer, built, chain, first, {"value": value})


def _cwe_words(seed: int) -> Iterator[str]:
    """A seeded order of distinct real words, then made-up ones if the text's vocabulary runs out."""
    words = list(vocabulary())
    random.Random(f"cwe-words:{seed}").shuffle(words)
    yield from words
    syllables = ["ba", "ko", "ri", "mu", "te", "lo", "sa", "ven", "dor", "pil", "nak", "fe"]
    rng = random.Random(f"cwe-made-up:{seed}")
    seen = set(words)
    while True:
        word = "".join(rng.choice(syllables) for _ in range(3))
        if word not in seen:
            seen.add(word)
            yield word


def _cwe(spec: TaskSpec, tokenizer: Any, continuation_tokens: int) -> Task:
    words = _cwe_words(spec.seed)
    common = [next(words) for _ in range(CWE_COMMON)]
    n_intro = count_tokens(tokenizer, _CWE_INTRO + "\n")
    per_entry = count_tokens(tokenizer, " 123. " + common[0]) or 1
    est_entries = max(1, (spec.context_tokens - n_intro) // per_entry)
    # RULER's 30 occurrences per common word, fewer in short contexts so rare words still fill half
    freq = max(CWE_RARE_FREQ + 1, min(CWE_COMMON_FREQ_MAX, est_entries // (2 * CWE_COMMON)))
    rare_pool: list[str] = []

    def rare_words(k: int) -> list[str]:
        while len(rare_pool) < k:
            rare_pool.append(next(words))
        return rare_pool[:k]

    def build(m: int) -> list[str]:
        """The shuffled list of ``m`` rare entries plus the common ones (same for the same m)."""
        rare = [w for w in rare_words(-(-m // CWE_RARE_FREQ)) for _ in range(CWE_RARE_FREQ)][:m]
        entries = [w for w in common for _ in range(freq)] + rare
        random.Random(f"cwe:{spec.seed}:{m}").shuffle(entries)
        return entries

    def text(entries: list[str]) -> str:
        return _CWE_INTRO + "\n" + " ".join(f"{i + 1}. {w}" for i, w in enumerate(entries))

    if count_tokens(tokenizer, text(build(0))) > spec.context_tokens:
        raise ValueError(
            f"context_tokens={spec.context_tokens} is too short for cwe: {CWE_COMMON} common words x {freq} "
            f"occurrences need {count_tokens(tokenizer, text(build(0)))} tokens"
        )
    lo, hi = 0, max(1, est_entries * 2)
    while count_tokens(tokenizer, text(build(hi))) <= spec.context_tokens:
        hi *= 2
    while lo < hi:  # the most rare entries that fit
        mid = (lo + hi + 1) // 2
        if count_tokens(tokenizer, text(build(mid))) <= spec.context_tokens:
            lo = mid
        else:
            hi = mid - 1
    entries = build(lo)
    context = text(entries)
    # the held-out continuation: the list goes on with new rare words
    more: list[str] = []
    while count_tokens(tokenizer, " " + " ".join(more)) < continuation_tokens:
        more.append(f"{len(entries) + len(more) + 1}. {next(words)}")
    return Task(
        spec=spec,
        context=context,
        question=_CWE_QUESTION.format(n=CWE_COMMON),
        answer_prefix=_CWE_ANSWER_PREFIX.format(n=CWE_COMMON),
        answers=tuple(common),
        metric="string_match_all",
        continuation=" ".join(more),
        max_new_tokens=MAX_NEW_TOKENS["cwe"],
        context_token_count=count_tokens(tokenizer, context),
        haystack_token_count=count_tokens(tokenizer, context[len(_CWE_INTRO) + 1 :]),
        extra={"common_frequency": freq, "rare_frequency": CWE_RARE_FREQ, "entries": len(entries)},
    )


def _niah_multiturn(spec: TaskSpec, tokenizer: Any, continuation_tokens: int) -> Task:
    """Four facts of four kinds in one context (a magic number, a vault's passcode, a bakery's phone number, an
    expedition's gold coins: :data:`_TURN_FACTS`), each with its own key and a 7-digit value; four turns, one fact
    each: the one at ``spec.depth`` first, the others in a seeded order. A later turn needs a fact the first question
    did not point at, which is where eviction at the context's end loses what a retrieval tier can bring back."""
    rng = random.Random(f"niah_multiturn:{spec.seed}")
    keys, values = _keys(rng, NUM_NEEDLES), _values(rng, NUM_NEEDLES)
    needles = [fact[0].format(key=k, value=v) for fact, k, v in zip(_TURN_FACTS, keys, values)]
    depths = [spec.depth] + [rng.random() for _ in range(NUM_NEEDLES - 1)]
    built = _assemble(
        tokenizer, _TURN_INTRO, haystack_sentences(spec.haystack, spec.seed),
        list(zip(depths, needles)), spec.context_tokens, continuation_tokens,
    )
    asked = [0] + rng.sample(range(1, NUM_NEEDLES), NUM_NEEDLES - 1)
    turns = [Turn(_TURN_FACTS[i][1].format(query=keys[i]), _TURN_FACTS[i][2].format(query=keys[i]), (values[i],))
             for i in asked]
    return _needle_task(spec, tokenizer, built, needles, turns[0], {"keys": keys, "values": values, "asked": asked},
                        tuple(turns[1:]))


_BUILDERS = {
    "niah_single": _niah, "niah_multikey": _niah, "niah_multivalue": _niah, "niah_multiquery": _niah,
    "vt": _vt, "cwe": _cwe, "niah_multiturn": _niah_multiturn,
}


def make_task(spec: TaskSpec | str, tokenizer: Any, *, continuation_tokens: int = 64, **spec_fields: Any) -> Task:
    """Build one task instance for ``tokenizer``: ``make_task("niah_single", tok, context_tokens=2000, depth=0.5)``.

    ``spec`` is a :class:`TaskSpec` or a task name (then ``spec_fields`` are its other fields); the same spec and
    tokenizer give the same text. ``continuation_tokens``: the held-out text's length (0: none, no ΔCE).
    """
    if isinstance(continuation_tokens, bool) or not isinstance(continuation_tokens, int) or continuation_tokens < 0:
        raise ValueError("continuation_tokens must be an int >= 0 (0: no held-out continuation, no ΔCE), got "
                         f"{continuation_tokens!r}")
    if isinstance(spec, str):
        spec = TaskSpec(task=spec, **spec_fields)
    elif spec_fields:
        raise TypeError("pass either a TaskSpec or a task name with fields, not both")
    if tokenizer is None:
        raise ValueError("tasks are sized in tokens and need a tokenizer; for tokenizer-less models use ByteTokenizer()")
    return _BUILDERS[spec.task](spec, tokenizer, continuation_tokens)


def fewest_context_tokens(context_tokens: int) -> int:
    """A lower bound on the tokens of a context built for ``context_tokens`` (a task's is within 1 % of it): what a
    refusal may count on before a context is built (building one of a hundred million tokens takes minutes)."""
    return context_tokens - max(context_tokens // 100, 64)


# --- the original demo's needle (kept for `kvzoo run` and the tests of the filler) ---------------

NEEDLE = "The special magic number for Lisbon is 7381924."
NEEDLE_VALUE = "7381924"
QUESTION = "What is the special magic number for Lisbon?"
CONTEXT_TOKENS = 2000
NEEDLE_DEPTH = 0.35  # deep enough to fall outside StreamingLLM's recent window at 4x (the last 25 %)


@dataclass(frozen=True)
class NeedleContext:
    """A filler context with one needle sentence; token counts by the tokenizer it was built for."""

    text: str
    needle: str
    context_tokens: int  # tokens of ``text`` (no special tokens)
    needle_start: int  # index of the needle's first token within ``text``'s tokens
    needle_tokens: int

    @property
    def depth(self) -> float:
        """Where the needle starts, as a fraction of the context (0 = first token)."""
        return self.needle_start / self.context_tokens


def build_needle_context(
    tokenizer: Any,
    context_tokens: int = CONTEXT_TOKENS,
    depth: float = NEEDLE_DEPTH,
    needle: str = NEEDLE,
    seed: int = 0,
) -> NeedleContext:
    """About ``context_tokens`` tokens of town filler with ``needle`` starting at ``depth`` of the way in (sentences
    counted with their leading space; the returned counts are measured on the final text)."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be a fraction in [0, 1], got {depth!r}")
    if context_tokens < 1:
        raise ValueError(f"context_tokens must be a positive number of tokens, got {context_tokens!r}")
    needle_count = count_tokens(tokenizer, " " + needle)
    filler_budget = max(0, context_tokens - needle_count)
    before_budget = round(depth * context_tokens)
    before: list[str] = []
    after: list[str] = []
    used = 0
    for sentence in filler_sentences(seed):
        n = count_tokens(tokenizer, " " + sentence)
        if used + n / 2 > filler_budget:  # stop at the sentence boundary nearest the budget
            break
        (before if used + n / 2 <= before_budget else after).append(sentence)
        used += n
    text = " ".join([*before, needle, *after])

    ids_before = tokenizer(" ".join(before), add_special_tokens=False).input_ids if before else []
    ids_total = tokenizer(text, add_special_tokens=False).input_ids
    return NeedleContext(
        text=text,
        needle=needle,
        context_tokens=len(ids_total),
        needle_start=len(ids_before),
        needle_tokens=needle_count,
    )
