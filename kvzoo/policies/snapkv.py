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

    The reference's ``update_kv``: the window queries' softmax attention over all rows (causal) is summed over the
    window, the non-window rows' sums are pooled along the sequence, and each KV head keeps its ``keep - w`` best
    non-window rows plus the ``w`` window rows (the budget counts the window, the reference's
    ``max_capacity_prompt``). Only the context is compressed, as in the reference.

    Defaults: ``window=32``, ``kernel_size=7``, ``pooling="maxpool"`` -- the paper's LongBench configurations
    (``experiments/LongBench/config/ablation_c*_w32_k7_maxpool.json``); the reference's fallback without one is
    ``kernel_size=5`` with ``avgpool`` (``F.avg_pool1d``, zero padding counted), what kvpress's ``SnapKVPress`` uses
    with a 64-query window; ``kernel_size=1`` switches pooling off. ``aggregate="mean"`` -- the paper scores per head (MHA); on GQA kvzoo keeps one selection per KV head
    so the cache really shrinks, averaging its query heads' pooled scores as kvpress does (SnapKV issue #22);
    ``"sum"`` ranks alike, ``"max"`` keeps a row any one query head needs. The deviations from the reference (fp32,
    ties, padding, a budget below the window refused) are listed in docs/fidelity.md.
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
