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

    Defaults: ``sinks=4`` -- the paper's (§3.2, "four initial tokens as attention sinks suffice"), the reference's
    ``start_size``; the recent window is what the budget leaves (the reference's ``recent_size``).
    ``schedule="step"`` -- the reference's rolling cache: each new row pushes out the oldest non-sink row;
    ``"block"`` evicts only when ``block_size`` rows have arrived since the last eviction (amortised).
    ``prefill="dense"`` -- a multi-token forward attends to every row the tier holds, then evicts, as the
    reference's ``examples/run_streaming_llama.py`` prefills; ``"stream"`` (kvzoo's option) lets each token of a
    forward read only the sinks and the ``budget - sinks`` latest rows up to its own, as if fed one at a time (the
    paper's streaming setting, ``examples/eval_long_ppl.py``).

    Deviations (docs/fidelity.md): keys stay rotated at their original positions (the reference re-rotates at the
    cache index), and eviction follows each forward, so a decode step reads ``budget + 1`` rows, its own included
    (as the perplexity script does; the example script evicts room for the whole generation before the prompt).
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
