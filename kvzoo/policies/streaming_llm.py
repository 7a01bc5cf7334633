"""``streaming_llm``: attention sinks plus a recent window.

Xiao et al., "Efficient Streaming Language Models with Attention Sinks", ICLR 2024,
https://arxiv.org/abs/2309.17453 (reference code: github.com/mit-han-lab/streaming-llm).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvzoo.framework.policy import Policy, RowsView, recent_and_sinks, sorted_keep

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
        if isinstance(self.sinks, bool) or not isinstance(self.sinks, int) or self.sinks < 0:
            raise ValueError(f"sinks must be an int >= 0, got {self.sinks!r}")
        if self.schedule not in STREAMING_SCHEDULES:
            raise ValueError(f"schedule must be one of {STREAMING_SCHEDULES}, got {self.schedule!r}")
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"block_size must be an int >= 1 (rows appended between evictions), got {self.block_size!r}")
        if self.budget is not None and self.budget <= self.sinks:
            raise ValueError(
                f"budget ({self.budget}) must exceed sinks ({self.sinks}) to leave room for a recent window"
            )

    def select(self, rows: RowsView, keep: int) -> torch.Tensor:
        sinks = min(self.sinks, keep)
        kept = recent_and_sinks(rows.valid, sinks, keep - sinks)
        # Padding rows are never kept by rank; fill any shortfall (fewer valid rows than `keep`)
        # with the latest padding rows so every (batch, group) keeps exactly `keep` rows.
        n = rows.num_rows
        order = torch.arange(n, device=kept.device).expand_as(kept)
        priority = torch.where(kept, order + n, order)  # kept rows first, then latest rows
        return sorted_keep(priority.topk(keep, dim=-1).indices)
