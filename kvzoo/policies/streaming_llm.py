"""``streaming_llm``: attention sinks plus a recent window.

Xiao et al., "Efficient Streaming Language Models with Attention Sinks", ICLR 2024,
https://arxiv.org/abs/2309.17453 (reference code: github.com/mit-han-lab/streaming-llm).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvzoo.framework.policy import (
    Policy,
    RowsView,
    keep_sinks_and_recent,
    require_int,
    sinks_and_recent_victim,
)

STREAMING_SCHEDULES = ("step", "block")


@dataclass
class StreamingLLM(Policy):
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

    Deviations: the reference also re-assigns positions inside the cache (it rotates keys at their
    cache index); kvzoo keeps every key rotated at its original position and decodes at the true
    sequence length, as DESIGN.md §3 requires for all policies.
    """

    sinks: int = 4
    schedule: str = "step"
    block_size: int = 256

    name: ClassVar[str] = "streaming_llm"
    summary: ClassVar[str] = "4 attention sinks + the most recent rows (rolling window)"
    paper: ClassVar[str] = "https://arxiv.org/abs/2309.17453"

    def validate(self) -> None:
        super().validate()
        require_int(self.sinks, "sinks", 0, "attention sinks kept at the start")
        if self.schedule not in STREAMING_SCHEDULES:
            raise ValueError(f"schedule must be one of {STREAMING_SCHEDULES}, got {self.schedule!r}")
        require_int(self.block_size, "block_size", 1, "rows appended between evictions")
        if self.budget is not None and self.budget <= self.sinks:
            raise ValueError(
                f"budget ({self.budget}) must exceed sinks ({self.sinks}) to leave room for a recent window"
            )

    def select(self, rows: RowsView, keep: int) -> torch.Tensor:
        return keep_sinks_and_recent(rows.valid, self.sinks, keep)

    def step_victim(self, rows: RowsView) -> torch.Tensor:
        return sinks_and_recent_victim(rows.slots, rows.valid, self.sinks)
