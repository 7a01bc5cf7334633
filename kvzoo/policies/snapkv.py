"""``snapkv``: the last window's attention, pooled, picks each KV head's rows; the window stays.

Li et al., "SnapKV: LLM Knows What You are Looking for Before Generation", NeurIPS 2024,
https://arxiv.org/abs/2404.14469 (reference code: github.com/FasterDecoding/SnapKV,
``snapkv/monkeypatch/snapkv_utils.py``, ``SnapKVCluster.update_kv``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvzoo.framework.policy import (
    RowsView,
    WindowPolicy,
    forced_priority,
    validate_votes,
    window_rows_mask,
    window_votes,
)


@dataclass
class SnapKV(WindowPolicy):
    """At the end of the context, the last ``window`` queries vote for the rows each KV head keeps.

    The algorithm (the reference's ``update_kv``): the window queries' softmax attention over all
    rows (causal: a window query never sees later window rows) is summed over the window, the sums
    of the non-window rows are pooled along the sequence (``kernel_size``, stride 1, padding
    ``kernel_size // 2``; the window's own rows are left out of the pooling, as the reference slices
    them off first), and each KV head keeps its ``keep - w`` best non-window rows plus the ``w``
    window rows. The budget counts the window (the reference's ``max_capacity_prompt``).

    Defaults and where they come from:

    * ``window=32`` -- the paper's observation window and the reference code's ``window_size``
      (``init_snapkv`` and the LongBench configurations ``experiments/LongBench/config/
      ablation_c*_w32_k7_maxpool.json``).
    * ``kernel_size=7``, ``pooling="maxpool"`` -- the paper's LongBench setting, i.e. those same
      configuration files. Known paper/code difference: when no configuration is given, the
      reference's ``init_snapkv`` falls back to ``kernel_size=5`` with ``pooling='avgpool'`` (the
      values kvpress's ``SnapKVPress`` also uses, with a 64-query window). ``"avgpool"`` is
      ``F.avg_pool1d`` with its default ``count_include_pad=True`` (the zero padding counts in the
      mean at both ends), exactly as the reference calls it. ``kernel_size=1`` switches pooling off.
    * ``aggregate="mean"`` -- how the scores of the query heads that share one KV head (GQA) become
      that KV head's score: ``"mean"`` (default), ``"sum"`` or ``"max"``. The paper scores per
      attention head (MHA); on GQA models kvzoo keeps one selection per KV head, so that the cache
      really shrinks, and averages the group's pooled scores like kvpress's ``SnapKVPress`` (which
      follows the discussion in FasterDecoding/SnapKV issue #22). ``"sum"`` ranks rows exactly like
      ``"mean"`` (a constant factor); ``"max"`` keeps a row that any one query head of the group
      needs. Pooling is applied per query head, then the group is aggregated (kvpress's order).

    Deviations from the reference, all known:

    * scores and softmax stay fp32 (the reference casts the softmax back to the model dtype before
      summing);
    * ties (frequent with max pooling, which copies a peak to its neighbours) go to the earlier row;
      the reference's ``topk`` leaves tie order unspecified;
    * padding rows (batched left padding) are never kept while valid rows are available, and the
      window is the last ``w`` *valid* rows; the reference assumes unpadded sequences;
    * the reference leaves a prompt shorter than ``max_capacity_prompt`` alone; here the runtime
      does nothing when the budget is not smaller than the rows held (the same), and a budget
      smaller than the window is an error (ValueError) instead of a silent over-budget cache;
    * with a chunked prefill the window is the last ``w`` queries across chunks (the reference
      compresses a single prefill).

    Only the context is compressed (event ``context_end``); rows added afterwards (question,
    generated tokens) stay, as in the reference, which compresses the prompt only.
    """

    kernel_size: int = 7
    pooling: str = "maxpool"
    aggregate: str = "mean"

    name: ClassVar[str] = "snapkv"
    summary: ClassVar[str] = "last-window attention, pooled, per-KV-head top-k; the window is kept"
    paper: ClassVar[str] = "https://arxiv.org/abs/2404.14469"

    def validate(self) -> None:
        super().validate()
        validate_votes(self.kernel_size, self.pooling, self.aggregate)

    def scores(self, rows: RowsView) -> torch.Tensor:
        """Pooled, group-aggregated votes ``[B, G, N]`` fp32; the window rows' own votes are zeroed
        (the reference pools only the non-window rows; a zero there equals its padding)."""
        return window_votes(rows, self.kernel_size, self.pooling, self.aggregate)

    def priority(self, rows: RowsView, keep: int) -> torch.Tensor:
        return forced_priority(self.scores(rows), window_rows_mask(rows), rows.valid)
