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

    The algorithm (Algorithm 1 of the paper): the last ``window`` queries attend to all rows
    (softmax, causal); a row's score is that attention summed over the window queries and over
    *all* query heads of the layer, so one selection serves every KV head of the layer, made per
    batch element. The rows outside the window are cut into chunks of ``chunk_size`` consecutive
    tokens, from each sequence's first token on; the last chunk is partial when the count does not
    divide (``ceil(P / c)`` chunks for ``P`` non-window rows). A chunk's score is the *sum* of its
    rows' scores. Chunks are ranked by score and their rows concatenated best chunk first; the first
    ``keep - w`` of those rows are kept, plus the ``w`` window rows. Algorithm 1 takes the top
    ``floor(L_max / c)`` chunks and keeps ``concat(K'[0 : L_max - w], K[T - w : T])`` without saying
    in which order ``K'`` holds the chosen chunks; kvzoo reads it as best chunk first, so the
    budget is met exactly with whole chunks, except that the lowest-ranked chunk taken may be cut
    (its leading rows are kept) when ``keep - w`` is not a multiple of ``chunk_size``.

    Layer-wise index reuse: layers are taken in groups of ``reuse`` consecutive layers
    (0..N-1, N..2N-1, ...); the first layer of each group scores and selects, the others keep
    the same token positions (slots) without scoring. ``ceil(num_layers / reuse)`` layers score.
    Groups count the layers that hold rows (``RowsView.layer_rank``): on a hybrid model (Kimi
    Linear: MLA layers hold rows, KDA layers none) a group is ``reuse`` consecutive MLA layers.
    ``cache.stats()`` reports ``chunkkv_scored`` and ``chunkkv_reused``: how many layers did each.

    Defaults and where they come from:

    * ``chunk_size=10`` -- the paper's default (its chunk-size ablation finds 10 the most robust);
      kvpress's ``ChunkKVPress`` uses ``chunk_length=20``.
    * ``reuse=2`` -- the paper's ``N_reuse = 2`` (every other layer reuses its predecessor's
      indices); ``reuse=1`` switches reuse off.
    * ``window=32`` -- Algorithm 1 takes the observation window ``w`` as an input without fixing
      it in the algorithm; ChunkKV builds on SnapKV's observation window, so kvzoo uses SnapKV's
      ``w = 32`` and the two policies compare at equal windows. Set ``window=`` to match a
      particular experiment's script.
    * ``kernel_size=1`` (no pooling), ``aggregate="sum"`` -- the paper's scorer: the window attention
      summed over the window queries and all heads. ``kernel_size > 1`` pools each query head's votes
      along the rows (``pooling``: ``avgpool`` or ``maxpool``) as SnapKV does; ``aggregate`` combines a
      KV group's query heads (``mean`` ranks rows like ``sum``; ``max`` differs).
    * ``tiling="paper"`` -- the window kept apart, chunks before it (below); ``"kvpress"`` is
      kvpress's tiling (next paragraph).

    Deviations, all known:

    * the window is left out of the chunking: Algorithm 1 chunks all ``T`` rows and then appends
      the window, which can take a window row twice; here the window is kept once and chunks tile
      the rows before it (chunk boundaries are the same as the paper's, counted from the first
      token);
    * in a left-padded batch chunks start at each sequence's first real token (padding is never
      chunked or kept while valid rows remain), so a padded sequence keeps what it would alone;
    * ties between chunks go to the earlier chunk (``topk`` leaves tie order unspecified);
    * the window scores are the window queries' *softmax* attention (fp32, causal, per query head), as SnapKV's
      and kvpress's scorers take them; the paper's Algorithm 1 writes the score as the plain product
      ``A = Q[T - w : T] K^T`` summed over the window and the heads, with no softmax. Both rank chunks by how
      much the window attends to them; they can rank differently (a softmax normalises each query's row, so a
      query with one sharp peak counts as much as one with a flat row). kvzoo keeps the softmax so that
      ``tiling="kvpress"`` reproduces kvpress's port exactly (``tests/kvpress/test_fidelity.py``);
    * scores and softmax are fp32; no pooling by default (Algorithm 1 has none).

    kvpress's port, ``ChunkKVPress(press=SnapKVPress(...))`` (kvpress 0.5.5), differs from the paper
    defaults here in: its scorer is SnapKV's (the window's mean attention, pooled per query head with
    ``kernel_size=5`` ``avgpool``, averaged over each KV group, summed over the groups), its
    ``chunk_length=20``, its 64-query window, no index reuse, and its tiling -- chunks tile every row
    from the first token, the window included, a window row scoring one above the best other row (per
    KV head, before the groups are summed), and a chunk's score is the *mean* of its rows. The fields
    ``kernel_size``, ``pooling``, ``aggregate``, ``chunk_size``, ``window``, ``reuse=1`` and
    ``tiling="kvpress"`` set every one of those, and then kvzoo keeps kvpress's rows exactly
    (``tests/kvpress/test_fidelity.py``, SmolLM2 and a tiny Llama) when the context and the kept rows
    are whole numbers of chunks. What stays different: kvpress keeps ``max(1, int(chunks * (1 -
    compression_ratio)))`` whole chunks, so its row count is not the runtime's budget otherwise (kvzoo
    keeps the budget exactly, cutting the last chunk taken), and it takes batch element 0's chunks for
    the whole batch (kvzoo chooses per sequence).

    A reusing layer reads nothing it does not need: the row scores its group's first layer stored with their slots,
    and its own slots (which must be the same). It computes no window attention -- the runtime computes a layer's window attention
    only when the selector asks for it, and the check that the window fits in the budget reads lengths alone
    (:meth:`~kvzoo.framework.policy.RowsView.window_size`); ``tests/test_chunkkv.py`` counts the calls
    (``ceil(num_layers / reuse)``). Measured on SmolLM2-135M (CHANGELOG.md, "ChunkKV's layer-wise index reuse"):
    ``python benchmarks/probe.py chunkkv-reuse``.
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
        """The scorer, ``[B, N]`` fp32: each row's window attention summed over the window queries, pooled along
        the rows per query head (``kernel_size``; 1 = none, the paper), combined over each KV group's query
        heads (``aggregate``) and summed over the KV groups. The window rows' own votes are zeroed (they are
        never chunked). With the defaults: the window attention summed over window queries and all heads."""
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
