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

    Every forward pass adds the attention each resident row received -- summed over all of that
    pass's queries -- to the row's accumulator (the reference's ``hh_score``, updated by
    ``_update_hh_score``), then the selector runs (event ``step``): after the prefill forward it
    evicts down to the budget; after each decode step one row came in, so exactly one row goes
    out, and the attended tier never holds more than the budget between steps. Heavy hitters are
    chosen among the rows outside the recent window (the reference's
    ``hh_score[:, :seq_len - recent_size]``). The accumulators are ``row_stats["attention"]``: the
    runtime computes them inside kvzoo's attention path (no eager attention, no ``T x T`` matrix
    kept: queries are processed in chunks) and gathers them with the rows when rows move.

    Defaults and where they come from:

    * ``heavy_fraction=0.5`` -- the share of the budget given to heavy hitters; the recent window
      gets the rest. The paper splits its KV budget equally between heavy hitters and recent
      tokens (the reference scripts pass ``heavy_ratio`` = ``recent_ratio``, e.g. 0.1 + 0.1 for a
      20 % cache). Rounding: ``heavy = floor(budget * heavy_fraction)``, ``recent = budget - heavy``
      (the reference floors both sizes separately and can hold one row fewer than its budget).

    GQA: the reference scores each attention head of an MHA model (OPT, LLaMA-1). On GQA models a
    KV head serves several query heads; its accumulator is the *sum* over its query heads (the
    runtime's ``column_sums``), and each KV head keeps its own rows.

    Deviations from the reference, all known:

    * accumulators are per batch element; the reference sums them over the batch (``sum(0)``), so
      its sequences in one batch share one selection;
    * eviction after the prefill uses the prefill's accumulated attention once, as the reference's
      real-drop implementation (``utils_real_drop``) does; its lm-eval simulation
      (``utils_lm_eval``) instead masks token by token inside the prefill;
    * ties go to the earlier row; padding rows are never kept while valid rows are available;
    * with a chunked prefill the step event fires after every chunk, so the tier is held at the
      budget during the prefill too (the reference prefills in one pass). A ``ratio`` budget is
      fixed at a layer's first event: it counts the whole context when the cache is told the
      context length (``kvzoo.pipeline`` does), otherwise only the first chunk -- pass ``budget=``
      when driving a chunked prefill yourself.
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
