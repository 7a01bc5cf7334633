"""``streaming_llm``: attention sinks plus a recent window.

Xiao et al., "Efficient Streaming Language Models with Attention Sinks", ICLR 2024,
https://arxiv.org/abs/2309.17453 (reference code: github.com/mit-han-lab/streaming-llm).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvzoo.framework.policy import SinksAndRecentPolicy, require_int

STREAMING_SCHEDULES = ("step", "block")
PREFILLS = ("dense", "stream")


@dataclass
class StreamingLLM(SinksAndRecentPolicy):
    """Keep the first ``sinks`` rows and the most recent rows; the budget counts both.

    Defaults and where they come from:

    * ``sinks=4`` -- the paper's choice (§3.2: "four initial tokens as attention sinks suffice"),
      also the reference code's ``start_size=4``.
    * the recent window is whatever the budget leaves after the sinks (the reference code's
      ``recent_size``; the paper's cache sizes are sinks + window).
    * ``schedule="step"`` -- the reference evicts at every decode step (a rolling cache): after
      the context is compressed, each new row pushes out the oldest non-sink row.
      ``schedule="block"`` evicts only when ``block_size`` rows have been appended since the last
      eviction, then drops back to the budget (amortised eviction; same rows kept at block ends).

    * ``prefill="dense"`` (default) -- a multi-token forward (the context's prefill, a question)
      attends to every row the tier holds, and the eviction follows the forward. This is what the
      reference's example script does (``examples/run_streaming_llama.py``): each prompt is prefilled
      whole and densely, over the rows the cache holds and the prompt's own. ``prefill="stream"`` is
      kvzoo's option, not the reference's prefill: inside a multi-token forward each token reads only
      the ``sinks`` first rows and the ``budget - sinks`` latest rows up to and including its own, as if
      the tokens had been fed one at a time with the cache at ``budget`` rows before each (the paper's
      streaming setting, which the reference's perplexity script ``examples/eval_long_ppl.py`` runs by
      feeding tokens one at a time).

    Deviations, all known:

    * the reference re-assigns positions inside the cache (it rotates keys at their cache index);
      kvzoo keeps every key rotated at its original position and decodes at the true sequence
      length, as docs/architecture.md requires of all policies;
    * when eviction happens: the reference's example script evicts *before* a prompt's forward
      (``evict_for_space(past_key_values, prompt_len + max_gen_len)`` makes room for the prompt and the
      whole generation at once, so no decode step reads more than ``budget`` rows); kvzoo evicts *after*
      each forward -- the context is prefilled densely and then evicted, a question after compression
      attends to budget + its own rows, and a decode step evicts after its attention (one in, one out),
      so a step reads ``budget + 1`` rows, its own included (the perplexity script, which evicts after
      each token's forward, reads the same ``budget + 1``).
    """

    schedule: str = "step"
    block_size: int = 256
    prefill: str = "dense"

    name: ClassVar[str] = "streaming_llm"
    summary: ClassVar[str] = "4 attention sinks + the most recent rows (rolling window)"
    paper: ClassVar[str] = "https://arxiv.org/abs/2309.17453"

    def validate(self) -> None:
        super().validate()
        if self.schedule not in STREAMING_SCHEDULES:
            raise ValueError(f"schedule must be one of {STREAMING_SCHEDULES}, got {self.schedule!r}")
        require_int(self.block_size, "block_size", 1, "rows appended between evictions")
        if self.prefill not in PREFILLS:
            raise ValueError(
                f"prefill must be one of {PREFILLS} ('dense': a multi-token forward reads every tier row; 'stream': "
                f"token by token, each token reads the sinks and the latest budget - sinks rows), got {self.prefill!r}"
            )
        if self.budget is not None:
            self.check_budget(self.budget)

    def check_budget(self, budget: int, source: str = "budget") -> None:
        if budget <= self.sinks:
            given = "" if source == "budget" else f" (from {source})"
            raise ValueError(
                f"budget ({budget} rows{given}) must exceed sinks ({self.sinks}) to leave room for a recent window; "
                f"use a smaller ratio, a larger budget, or fewer sinks"
            )

    def multi_token_window(self, budget: int) -> tuple[int, int] | None:
        if self.prefill != "stream":
            return None
        sinks = min(self.sinks, budget - 1)
        return sinks, budget - sinks
