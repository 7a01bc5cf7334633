"""``h2o``: heavy hitters by accumulated attention plus a recent window, evicted every step.

Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language
Models", NeurIPS 2023, https://arxiv.org/abs/2306.14048 (reference code: github.com/FMInference/H2O,
``h2o_hf/utils_real_drop/modify_llama.py``, ``H2OKVCache_LayerWise``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvzoo.framework.policy import Observation, Policy, RowsView, forced_priority


@dataclass
class H2O(Policy):
    """Keep the ``budget - recent`` rows with the most accumulated attention, plus the ``recent`` latest rows.

    Every forward adds the attention each resident row received, summed over that pass's queries (and, on GQA, over
    the query heads of its KV head), to ``row_stats["attention"]`` (the reference's ``hh_score``); then the selector
    runs (event ``step``): after the prefill it evicts down to the budget, after each decode step exactly one row
    goes. Heavy hitters are chosen among the rows outside the recent window.

    Defaults: ``heavy_fraction=0.5`` -- the paper splits its budget equally between heavy hitters and recent tokens
    (its scripts pass ``heavy_ratio = recent_ratio``); ``heavy = floor(budget * heavy_fraction)``, ``recent = budget
    - heavy``. The deviations from the reference (per-batch-element accumulators, ties, a chunked prefill firing
    per chunk: pass ``budget=`` when driving one yourself) are listed in docs/fidelity.md.
    """

    heavy_fraction: float = 0.5

    name: ClassVar[str] = "h2o"
    summary: ClassVar[str] = "heavy hitters by accumulated attention + recent rows, one in one out per step"
    paper: ClassVar[str] = "https://arxiv.org/abs/2306.14048"
    observes: ClassVar[frozenset[Observation]] = frozenset({Observation.ACCUMULATE})
    schedule: ClassVar[str] = "step"

    def validate(self) -> None:
        super().validate()
        f = self.heavy_fraction
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not math.isfinite(f) or not 0 <= f <= 1:
            raise ValueError(
                f"heavy_fraction must be a number in [0, 1] (share of the budget for heavy hitters; the rest is "
                f"the recent window), got {f!r}"
            )

    def split(self, keep: int) -> tuple[int, int]:
        """``(heavy, recent)`` row counts for a budget of ``keep`` rows."""
        heavy = math.floor(keep * self.heavy_fraction)
        return heavy, keep - heavy

    def priority(self, rows: RowsView, keep: int) -> torch.Tensor:
        """The accumulated attention, the ``recent`` latest valid rows forced (read by slot: any row order)."""
        _, recent = self.split(keep)
        return forced_priority(rows.row_stats["attention"], rows.recent(recent), rows.valid, rows.all_valid)
