"""``chunkkv``: keep whole chunks of tokens ranked by observation-window attention; reuse indices across layers.

Liu et al., "ChunkKV: Semantic-Preserving KV Cache Compression for Efficient Long-Context LLM
Inference", NeurIPS 2025, https://arxiv.org/abs/2502.00299 (Algorithm 1, ChunkKV; and its
layer-wise index reuse).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvzoo.framework.policy import (
    Counters,
    RowsView,
    WindowPolicy,
    require_int,
    validate_votes,
    window_rows_mask,
    window_votes,
)

# rows.shared[PRIORITY_KEY][layer_rank of a group's first layer] = (slots [B, N], row priority [B, N], layer_idx)
PRIORITY_KEY = "chunkkv_priority"
TILINGS = ("paper", "kvpress")


@dataclass
class ReuseCounts(Counters):
    """What a layer did at its event (``cache.stats()`` sums them: how many layers did each)."""

    chunkkv_scored: int = 0  # 1: it scored its rows
    chunkkv_reused: int = 0  # 1: it kept the slots its reuse group's first layer kept


@dataclass
class ChunkKV(WindowPolicy):
    """At the end of the context, keep the chunks of ``chunk_size`` tokens the last window attends to most.

    Algorithm 1 of the paper: a row's score is the last ``window`` queries' attention summed over those queries and
    over *all* query heads of the layer (one selection for every KV head, per batch element). The rows before the
    window are cut into chunks of ``chunk_size`` tokens from each sequence's first token; a chunk scores the sum of
    its rows. Rows are taken best chunk first until ``keep - w`` rows (the last chunk taken may be cut), plus the
    ``w`` window rows. Layer-wise index reuse: in each group of ``reuse`` consecutive layers that hold rows
    (``RowsView.layer_rank``: on Kimi Linear, MLA layers only) the first scores and the others keep its slots,
    computing no window attention; ``cache.stats()`` reports ``chunkkv_scored`` and ``chunkkv_reused``.

    Defaults: ``chunk_size=10`` and ``reuse=2`` are the paper's (its ablation finds chunks of 10 the most robust;
    ``reuse=1`` switches reuse off); ``window=32`` is SnapKV's (Algorithm 1 fixes none), so the two compare at equal
    windows; ``kernel_size=1``, ``aggregate="sum"`` are the paper's scorer (no pooling). ``tiling="kvpress"`` with
    kvpress's settings (``chunk_length=20``, a 64-query window, no index reuse, pooling with ``kernel_size=5``)
    reproduces ``ChunkKVPress`` exactly (``tests/kvpress/test_fidelity.py``). The deviations from
    the paper (softmax window scores, the window not chunked, per-sequence chunks, ties to the earlier chunk) are
    listed in docs/fidelity.md.
    """

    chunk_size: int = 10
    reuse: int = 2
    kernel_size: int = 1  # Algorithm 1 does not pool; kvpress's ChunkKVPress(SnapKVPress) pools with 5
    pooling: str = "avgpool"  # used when kernel_size > 1 (kvpress's SnapKVPress: avgpool)
    aggregate: str = "sum"  # query heads of a KV group: sum (the paper sums over all heads); kvpress: mean
    tiling: str = "paper"  # "paper": the window kept apart, chunks before it; "kvpress": ChunkKVPress's tiling

    name: ClassVar[str] = "chunkkv"
    summary: ClassVar[str] = "top chunks of c tokens by observation-window attention + the window; layer-wise index reuse"
    paper: ClassVar[str] = "https://arxiv.org/abs/2502.00299"

    def validate(self) -> None:
        super().validate()
        require_int(self.chunk_size, "chunk_size", 1, "tokens per chunk; the paper uses 10")
        require_int(self.reuse, "reuse", 1, "layers sharing one layer's indices; 1 = no reuse, the paper uses 2")
        validate_votes(self.kernel_size, self.pooling, self.aggregate)
        if self.tiling not in TILINGS:
            raise ValueError(f"tiling must be one of {TILINGS} ('paper': the window kept apart, chunks tile the rows "
                             f"before it; 'kvpress': chunks tile every row, as kvpress's ChunkKVPress), got {self.tiling!r}")

    def row_scores(self, rows: RowsView) -> torch.Tensor:
        """The scorer, ``[B, N]`` fp32: :func:`window_votes` summed over the KV groups (the window rows' own zeroed)."""
        return window_votes(rows, self.kernel_size, self.pooling, self.aggregate).sum(dim=1)

    def priority(self, rows: RowsView, keep: int) -> torch.Tensor:
        """Each row scores its chunk's score ``[B, G, N]`` (one selection for the layer's KV heads), so the top
        ``keep`` rows (ties to the earlier row) are the best chunks whole, in rank order, the last one cut. The
        window is ``+inf`` (paper tiling), padding ``-inf``. A layer that reuses indices scores its rows as the
        first layer of its group scored the same slots, so it keeps the same slots."""
        B, G, N = rows.slots.shape
        rank = rows.layer_rank  # position among the layers that hold rows (groups skip Kimi's KDA layers)
        first = rank - rank % self.reuse
        if rank == first:  # the first layer of its reuse group: score
            priority = self._row_priority(rows)
            rows.shared.setdefault(PRIORITY_KEY, {})[rank] = (rows.slots[:, 0].clone(), priority, rows.layer_idx)
            rows.info.update(ReuseCounts(chunkkv_scored=1).as_dict())
            return priority[:, None, :].expand(B, G, N)
        stored = rows.shared.get(PRIORITY_KEY, {}).get(first)
        if stored is None or not torch.equal(stored[0], rows.slots[:, 0]):
            layer = stored[2] if stored is not None else f"#{first} (counting layers that hold rows)"
            raise RuntimeError(
                f"chunkkv: layer {rows.layer_idx} reuses the indices of layer {layer} (reuse={self.reuse}), but that "
                "layer scored no rows with these slots at this event; index reuse needs all layers to hold the same "
                "rows and to be compressed in order 0..L-1 at each event -- use reuse=1 otherwise"
            )
        rows.info.update(ReuseCounts(chunkkv_reused=1).as_dict())
        return stored[1][:, None, :].expand(B, G, N)

    def _row_priority(self, rows: RowsView) -> torch.Tensor:
        """``[B, N]`` fp32: each row's chunk score (shared by the layer's KV heads); window rows ``+inf`` (paper
        tiling), padding ``-inf``. Sorted descending with ties to the earlier row, the rows come best chunk first,
        in sequence order inside a chunk (Algorithm 1's ``K'`` as kvzoo reads it)."""
        valid = rows.valid[:, 0]  # [B, N]; padding is per token, the same for every KV head
        window = window_rows_mask(rows)[:, 0]
        B, N = valid.shape
        if self.tiling == "paper":  # the window kept apart; chunks tile the rows before it, scored by their sum
            scores = self.row_scores(rows)
            chunked = valid & ~window
        else:  # kvpress: chunks tile every row; a window row scores one above the best other row, per KV head
            votes = window_votes(rows, self.kernel_size, self.pooling, self.aggregate)  # [B, G, N]
            others = votes.masked_fill(~(valid & ~window)[:, None], -torch.inf)
            top = others.amax() if bool(torch.isfinite(others).any()) else votes.new_zeros(())
            scores = torch.where(window[:, None], top + 1, votes).sum(dim=1)
            chunked = valid
        chunk = (chunked.long().cumsum(-1) - 1).clamp(min=0) // self.chunk_size  # [B, N], meaningful where chunked
        n_chunks = max(1, -(-N // self.chunk_size))
        chunk_scores = torch.zeros(B, n_chunks, dtype=torch.float32, device=scores.device)
        chunk_scores.scatter_add_(1, chunk, torch.where(chunked, scores, torch.zeros_like(scores)).float())
        if self.tiling == "kvpress":  # the mean: a partial last chunk competes as if whole
            sizes = torch.zeros_like(chunk_scores).scatter_add_(1, chunk, chunked.float())
            chunk_scores = chunk_scores / sizes.clamp(min=1)
        priority = chunk_scores.gather(1, chunk)  # every row of a chunk scores the chunk: one value, one rank
        if self.tiling == "paper":
            priority = priority.masked_fill(window, torch.inf)
        return priority.masked_fill(~valid, -torch.inf)
