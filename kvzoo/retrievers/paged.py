"""VestigeKV's paged int8 index (``index="paged"``, GQA): the int8 key entries under a coarse page summary.

Per ``page_rows`` archived rows one summary (key min/max as int8 codes, ``2 D + 4`` bytes) in Quest's
:class:`~kvzoo.retrievers.quest.PageSummary`. A decode step scans every summary with Quest's certified bound, takes
each query head's top ``fine_pages`` pages, and keeps, of their rows' int8 entries, each head's top ``j`` by estimate
whose row and page bounds are both above ``s* - j_margin``: ``pages x (2 D + 5) + heads x fine_pages x page_rows x
(D + 6)`` bytes read instead of ``rows x (D + 6)``. ``certified=True`` scans every row's entry, as ``index="int8"``.
"""

from __future__ import annotations

import torch

from kvzoo.framework.retriever import Choice
from kvzoo.kernels.index_scan import int8_page_bounds, int8_row_bounds, unique_candidates
from kvzoo.retrievers.int8 import Int8KeyIndex


class PagedKeyIndex(Int8KeyIndex):
    """The int8 key entries of :class:`~kvzoo.retrievers.int8.Int8KeyIndex` under a page summary scanned first."""

    def __init__(self, config, geometry) -> None:
        super().__init__(config, geometry)
        self.page_size = config.page_rows  # the audit checks each page's bound against its rows' best score

    def _summarised(self) -> bool:
        return True  # the coarse level this index ranks pages by

    def scan_cost(self, query_rows: int) -> tuple[int, int]:
        """Every page summary (a fixed index: every page slot, the unused ones empty), then ``fine_pages x page_rows``
        rows' int8 entries per query row (the certified mode: every row's entry)."""
        pages = self.summary.entries()
        if self.config.certified:
            return pages, self.rows.n * self.entry_bytes
        fine = query_rows * min(self.config.fine_pages, pages) * self.page_size * self.entry_bytes
        return pages, pages * self.page_bytes + fine

    def _page_bounds(self, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """Page bounds ``[B, G, hq, p]`` for the grouped queries (``-inf`` for empty and unused pages)."""
        B = query.shape[0]
        length = self.pages.length.expand(B) if self.pages.fixed else None
        pages = self.pages
        bounds = int8_page_bounds(self._grouped(query), pages.reading("codes"), pages.reading("scale"), scaling,
                                  length=length)
        return bounds.masked_fill_(pages.reading("empty")[:, :, None], float("-inf"))

    def bounds(self, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """The page bounds ``[B, H, q, p]`` (what :meth:`choose` scans first; each covers its page's rows)."""
        B, H, q_len, _ = query.shape
        return self._page_bounds(query, scaling).view(B, H, q_len, -1)

    def choose(self, query, best, scaling, archive) -> Choice:
        if self.config.certified:
            return super().choose(query, best, scaling, archive)
        B, H, q_len, D = query.shape
        G = self.groups
        hq = (H // G) * q_len
        size = self.page_size
        page_bounds = self._page_bounds(query, scaling)  # [B, G, hq, p]
        top_bounds, pages = page_bounds.topk(min(self.config.fine_pages, page_bounds.shape[-1]), dim=-1)
        rows = (pages[..., None] * size + torch.arange(size, device=query.device)).flatten(-2)  # [B, G, hq, K]
        if self.page_shift is not None:  # pages from each sequence's first real row
            rows = rows - self.page_shift[:, :, None, None]
        K = rows.shape[-1]
        live = self.rows.length if self.rows.fixed else self.rows.n  # rows indexed
        staged = rows.clamp(min=0, max=self.rows.capacity - 1)
        names = ("codes", "side", "valid") if archive.padded else ("codes", "side")  # padding rows: never chosen
        entries = self.rows.gather(staged.view(B, G, hq * K), names)
        bound, estimate = int8_row_bounds(self._grouped(query), entries["codes"].view(B, G, hq, K, D),
                                          entries["side"].view(B, G, hq, K, -1), scaling)
        page_of_row = top_bounds[..., None].expand(B, G, hq, top_bounds.shape[-1], size).flatten(-2)
        usable = (rows < live) & (rows >= 0) & (page_of_row > float("-inf"))
        if archive.padded:
            usable &= entries["valid"].view(B, G, hq, K)
        estimate = estimate.masked_fill(~usable, float("-inf"))
        picked = estimate.topk(min(self.config.j, K), dim=-1).indices  # [B, G, hq, j]
        s_star = (best - self.config.j_margin).reshape(B, G, hq, 1)
        ok = (bound.gather(-1, picked) > s_star) & (page_of_row.gather(-1, picked) > s_star) \
            & usable.gather(-1, picked)
        return Choice(*unique_candidates(staged.gather(-1, picked).view(B, G, -1), ok.view(B, G, -1),
                                         archive.rows or self.rows.capacity))
