"""``quest``: query-aware page selection over an archive that deletes nothing.

Tang et al., "Quest: Query-Aware Sparsity for Efficient Long-Context LLM Inference", ICML 2024,
https://arxiv.org/abs/2406.10774 (reference code: github.com/mit-han-lab/Quest).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from kvzoo.framework.policy import (
    Policy,
    RowsView,
    keep_sinks_and_recent,
    require_int,
    sinks_and_recent_victim,
)
from kvzoo.framework.retrieval import Choice, RetrievalState, Retriever, RowGeometry
from kvzoo.framework.store import RowStore
from kvzoo.kernels.index_scan import index_scan, page_query


@dataclass
class Quest(Policy):
    """Attend to 4 sinks + the latest page every step, and fetch back the pages whose keys could matter.

    Quest keeps the whole KV cache and, at every decode step, reads only the pages (16 consecutive
    tokens) whose upper bound ``sum_i max(q_i min_i, q_i max_i)`` is among the top
    ``ceil(budget / 16)``. In kvzoo that is a selector and a retriever: the attended tier holds the
    ``sinks`` first rows and the ``recent`` latest rows (schedule ``step``: every forward moves the
    rows that left the window to the archive -- nothing is deleted, ``archive`` must stay True), and
    the ``"quest"`` retriever indexes the archive by pages and fetches the top pages each step.
    The budget (``ratio``/``budget``) sizes the pages fetched, as Quest's token budget does.

    Defaults: ``page_size=16`` and ``dense_layers=2`` (the reference skips its first two layers,
    which it keeps dense) are Quest's; ``sinks=4`` and ``recent=16`` (one page, Quest always reads
    the current page) are kvzoo's. Deviations: the reference scores pages per query head; on GQA
    kvzoo scores a page per KV head by the max over its query heads (an upper bound for each), and
    fetches for a forward's queries together (the union of their top pages).
    """

    sinks: int = 4
    recent: int = 16
    page_size: int = 16
    dense_layers: int = 2
    retriever: Any = "quest"

    name: ClassVar[str] = "quest"
    summary: ClassVar[str] = "sinks + current page attended; top pages by per-page key min/max bound fetched each step"
    paper: ClassVar[str] = "https://arxiv.org/abs/2406.10774"
    schedule: ClassVar[str] = "step"

    def validate(self) -> None:
        super().validate()
        for field_name, low in (("sinks", 0), ("recent", 1), ("page_size", 1), ("dense_layers", 0)):
            require_int(getattr(self, field_name), field_name, low)
        if not self.archive:
            raise ValueError("quest deletes nothing: archive must be True (pages are fetched back from it)")

    def is_dense(self, layer_rank: int) -> bool:
        return layer_rank < self.dense_layers

    def target_rows(self, event, *, rows_seen, resident, fixed_budget, block_rows=0):  # noqa: ANN001 - as base
        attended = self.sinks + self.recent
        return attended if resident > attended else None

    def select(self, rows: RowsView, keep: int) -> torch.Tensor:
        return keep_sinks_and_recent(rows.valid, self.sinks, keep)

    def step_victim(self, rows: RowsView) -> torch.Tensor:
        return sinks_and_recent_victim(rows.slots, rows.valid, self.sinks)


@dataclass
class QuestRetriever(Retriever):
    """Pages of ``page_size`` consecutive archived rows with element-wise key min/max per page.

    Each query picks the top ``pages`` pages per KV group (default ``ceil(budget / page_size)``
    with the layer's budget), a page scored by the max over the group's query heads of Quest's
    bound; a forward fetches the union of its queries' pages (``framework/retrieval.py``). The last
    page may be partial. On MLA rows the "key" is the whole 576-dim latent row and the query the
    absorbed query (the bound holds for any vectors).
    """

    page_size: int = 16
    pages: int | None = None

    name: ClassVar[str] = "quest"

    def __post_init__(self) -> None:
        require_int(self.page_size, "page_size", 1, "rows per page")
        if self.pages is not None:
            require_int(self.pages, "pages", 1, "pages fetched per step; None: from the budget")

    def new_state(self, geometry: RowGeometry) -> PageIndex:
        return PageIndex(self)


class PageIndex(RetrievalState):
    """One index row per page of ``page_size`` archived rows, ``[max, min, max|k|]`` (``kernels/index_scan.py``).

    The last page may be partial: its row is updated in place as rows join it. A page of padding
    rows only keeps ``max = -inf``, ``min = +inf`` and is flagged empty (never fetched).
    """

    needs_best = False

    def __init__(self, config: QuestRetriever) -> None:
        self.config = config
        self.page_size = config.page_size
        self.pages = RowStore()  # "entries" [B, G, p, 2 D + 1] fp32, "empty" [B, G, p] bool
        self.rows = 0  # archived rows indexed

    @property
    def entry_bytes(self) -> int:  # type: ignore[override]
        if not self.pages.buffers:
            return 0
        entries = self.pages.buffers["entries"]
        return entries.shape[-1] * entries.element_size()

    @property
    def page_min(self) -> torch.Tensor:
        """Element-wise minimum of each page's keys ``[B, G, p, D]`` (+inf for an empty page)."""
        D = (self.pages.get("entries").shape[-1] - 1) // 2
        return self.pages.get("entries")[..., D : 2 * D]

    @property
    def page_max(self) -> torch.Tensor:
        """Element-wise maximum of each page's keys ``[B, G, p, D]`` (-inf for an empty page)."""
        D = (self.pages.get("entries").shape[-1] - 1) // 2
        return self.pages.get("entries")[..., :D]

    def index(self, rows, block_keys, block_valid, archive) -> None:  # noqa: ANN001
        size = self.page_size
        new = rows["keys"].float()
        valid = rows["valid"]
        lo = new.masked_fill(~valid[..., None], float("inf"))  # padding rows never widen a page
        hi = new.masked_fill(~valid[..., None], float("-inf"))
        B, G, k, D = new.shape
        if not self.pages.buffers:
            self.pages.define(B, G, {"entries": ((2 * D + 1,), torch.float32), "empty": ((), torch.bool)}, new.device)
        if self.rows % size:  # the last page is partial: merge the new rows into its index row
            fill = min(size - self.rows % size, k)
            last = self.pages.get("entries")[:, :, -1]  # [B, G, 2 D + 1], a view: updated in place
            torch.maximum(last[..., :D], hi[:, :, :fill].amax(2), out=last[..., :D])
            torch.minimum(last[..., D : 2 * D], lo[:, :, :fill].amin(2), out=last[..., D : 2 * D])
            magnitude = new[:, :, :fill].abs().masked_fill(~valid[:, :, :fill, None], 0).amax(dim=(2, 3))
            torch.maximum(last[..., -1], magnitude, out=last[..., -1])
            self.pages.get("empty")[:, :, -1] &= ~valid[:, :, :fill].any(2)
            lo, hi, valid = lo[:, :, fill:], hi[:, :, fill:], valid[:, :, fill:]
            self.rows += fill
        k = lo.shape[2]
        if k:
            pages = math.ceil(k / size)
            pad = pages * size - k
            lo = torch.cat([lo, lo.new_full((B, G, pad, D), float("inf"))], 2).view(B, G, pages, size, D).amin(3)
            hi = torch.cat([hi, hi.new_full((B, G, pad, D), float("-inf"))], 2).view(B, G, pages, size, D).amax(3)
            empty = torch.isinf(lo).all(-1)
            magnitude = torch.maximum(lo.abs(), hi.abs()).masked_fill(empty[..., None], 0).amax(-1, keepdim=True)
            self.pages.append({"entries": torch.cat([hi, lo, magnitude], dim=-1), "empty": empty})
            self.rows += k

    def entries(self) -> int:
        return self.pages.n

    def bounds(self, query: torch.Tensor, scaling: float) -> torch.Tensor:
        B, H, q_len, _ = query.shape
        entries = self.pages.get("entries")
        G = entries.shape[1]
        bounds = index_scan(page_query(query, G), entries, scaling)  # [B, G, hpg * q, p]
        bounds = bounds.masked_fill(self.pages.get("empty")[:, :, None], float("-inf"))  # empty pages: never
        return bounds.view(B, H, q_len, -1)

    def n_pages(self, budget: int | None) -> int:
        return min(self.pages.n, self.config.pages or max(1, math.ceil((budget or 0) / self.page_size)))

    def choose(self, query, best, scaling, archive) -> Choice:  # noqa: ANN001
        bounds = self.bounds(query, scaling)  # [B, H, q, p]
        B, H, q_len, p = bounds.shape
        G = archive.keys.shape[1]
        group_score = bounds.view(B, G, H // G, q_len, p).amax(dim=2)  # [B, G, q, p]: per query
        pages = group_score.topk(self.n_pages(archive.budget), dim=-1).indices  # [B, G, q, n]
        rows = pages[..., None] * self.page_size + torch.arange(self.page_size, device=pages.device)
        rows = rows.view(B, G, -1)
        return Choice(rows=rows.clamp(max=self.rows - 1), ok=rows < self.rows)  # the last page may be partial

    def select_batch(self, index: torch.Tensor) -> None:
        self.pages.select_batch(index)
        if self.last_min is not None:
            self.last_min, self.last_max = self.last_min.index_select(0, index), self.last_max.index_select(0, index)

    def repeat_batch(self, repeats: int) -> None:
        self.pages.repeat_batch(repeats)
        if self.last_min is not None:
            self.last_min = self.last_min.repeat_interleave(repeats, dim=0)
            self.last_max = self.last_max.repeat_interleave(repeats, dim=0)
