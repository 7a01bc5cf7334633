"""``python -m kvzoo.demo`` (``make demo``): a needle deep in a 2k-token context, full cache vs StreamingLLM.

SmolLM2-135M-Instruct reads ~2,000 tokens of varied filler with one fact (the *needle*) placed at
35 % depth, then answers a question about it. The question is shown only after the cache has
been compressed, so a policy cannot know what will be asked. StreamingLLM at 4x keeps 4 sink
tokens and the most recent quarter of the context: a needle at 35 % depth lies outside that
window, so we expect it to be lost while the full cache keeps it. The demo reports what actually
happened either way, and exits 0 whatever the answers are.

Runs in about 20 s on 2 CPU cores once the converted model is cached (the first run converts
the GGUF file, ~17 s more).
"""

from __future__ import annotations

import random
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

NEEDLE = "The special magic number for Lisbon is 7381924."
NEEDLE_VALUE = "7381924"
QUESTION = "What is the special magic number for Lisbon?"
CONTEXT_TOKENS = 2000
NEEDLE_DEPTH = 0.35  # deep enough to fall outside StreamingLLM's recent window at 4x (the last 25 %)
RATIO = 4

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
    rng = random.Random(seed)
    previous = None
    while True:
        template = rng.choice(_TEMPLATES)
        if template == previous:  # no sentence shape twice in a row
            continue
        previous = template
        text, rest = "", template
        while "{" in rest:
            head, _, tail = rest.partition("{")
            slot, _, rest = tail.partition("}")
            text += head + rng.choice(_WORDS[slot])
        text += rest
        text = re.sub(r"\b([Aa]) (?=[aeiou])", r"\1n ", text)  # "a old room" -> "an old room"
        yield text[0].upper() + text[1:]


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
    """About ``context_tokens`` tokens of filler with ``needle`` starting at ``depth`` of the way in.

    Sentences are joined by spaces; a byte-level BPE tokenizer splits at a space-word boundary,
    so the token count of the text is (to within a token or two) the sum of the sentences' counts,
    each taken with its leading space. The returned counts are measured on the final text.
    """
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be a fraction in [0, 1], got {depth!r}")
    if context_tokens < 1:
        raise ValueError(f"context_tokens must be a positive number of tokens, got {context_tokens!r}")

    def count(sentence: str) -> int:
        return len(tokenizer(" " + sentence, add_special_tokens=False).input_ids)

    needle_count = count(needle)
    filler_budget = max(0, context_tokens - needle_count)
    before_budget = round(depth * context_tokens)
    before: list[str] = []
    after: list[str] = []
    used = 0
    for sentence in filler_sentences(seed):
        n = count(sentence)
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


def _token_span(tokenizer: Any, ids: list[int], snippet: str) -> tuple[int, int]:
    """``[start, end)`` token indices of ``snippet`` in ``ids`` (found by decoding prefixes)."""
    full = tokenizer.decode(ids)
    char_start = full.index(snippet)

    def first(predicate: Any) -> int:  # smallest k in [0, len] with predicate(k) true (monotone)
        lo, hi = 0, len(ids)
        while lo < hi:
            mid = (lo + hi) // 2
            if predicate(mid):
                hi = mid
            else:
                lo = mid + 1
        return lo

    end = first(lambda k: snippet in tokenizer.decode(ids[:k]))
    start = first(lambda k: len(tokenizer.decode(ids[:k + 1])) > char_start)
    return start, end


def main() -> int:
    import torch

    from kvzoo import pipeline, registry
    from kvzoo.models import load_smollm2

    torch.manual_seed(0)
    print("kvzoo demo: needle in a haystack, full cache vs StreamingLLM at 4x, question after compression")
    t = time.perf_counter()
    model, tokenizer = load_smollm2(torch.float32)
    print(f"model: SmolLM2-135M-Instruct (fp32, CPU), loaded in {time.perf_counter() - t:.1f} s")

    ctx = build_needle_context(tokenizer)
    print(f"context: {ctx.context_tokens} tokens of filler; needle {ctx.needle!r}")
    print(
        f"needle at token {ctx.needle_start} of the context ({ctx.depth:.0%} depth), "
        f"{ctx.needle_tokens} tokens long; question (shown after compression): {QUESTION!r}"
    )
    prefix, _ = pipeline.build_prompt(tokenizer, ctx.text, QUESTION)
    prompt_ids = prefix[0].tolist()
    needle_start, needle_end = _token_span(tokenizer, prompt_ids, NEEDLE_VALUE)
    print(
        f"prompt before the question: {len(prompt_ids)} tokens (chat template + context); "
        f"the needle's value {NEEDLE_VALUE} is at tokens [{needle_start}, {needle_end})"
    )

    runs = [("full", registry.get("full")), (f"streaming_llm {RATIO}x", registry.get("streaming_llm", ratio=RATIO))]
    found: dict[str, bool] = {}
    for label, policy in runs:
        print(f"\n=== {label}: {policy!r}")
        result = pipeline.generate(
            model, tokenizer, ctx.text, QUESTION, policy, max_new_tokens=24, question_position="after"
        )
        found[label] = NEEDLE_VALUE in result.answer
        timings = ", ".join(f"{k.removesuffix('_s')} {v:.2f} s" for k, v in result.timings.items())
        print(f"answer: {result.answer!r}")
        print(f"contains the needle value {NEEDLE_VALUE}: {'yes' if found[label] else 'NO'}")
        print(f"prefilled {result.context_tokens} tokens before the question; {timings}")
        print(result.stats)

    streaming = runs[1][1]
    kept = streaming.resolve_budget(len(prompt_ids))  # rows per layer and KV head after compression
    window_start = len(prompt_ids) - (kept - streaming.sinks)
    where = "outside" if needle_end <= window_start else "inside"
    verdict = {True: "found the needle", False: "lost the needle"}
    print(
        f"\nsummary: full {verdict[found['full']]}; streaming_llm {RATIO}x {verdict[found[runs[1][0]]]}. "
        f"At compression it kept {streaming.sinks} sink tokens + the last {kept - streaming.sinks} of "
        f"{len(prompt_ids)} (tokens [{window_start}, {len(prompt_ids)})); the needle value at tokens "
        f"[{needle_start}, {needle_end}) lay {where} that window."
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
