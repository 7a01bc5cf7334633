"""``quest``: query-aware page selection over an archive that deletes nothing.

Tang et al., "Quest: Query-Aware Sparsity for Efficient Long-Context LLM Inference", ICML 2024,
https://arxiv.org/abs/2406.10774 (reference code: github.com/mit-han-lab/Quest).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from kvzoo.framework.buffers import RowStore
from kvzoo.framework.policy import (
    Policy,
    RowsView,
    keep_sinks_and_recent,
    require_int,
    sinks_and_recent_victim,
)
from kvzoo.framework.retriever import Choice, RetrievalState, Retriever, RowGeometry
from kvzoo.kernels.index_scan import index_scan, index_scan_reduce, page_query

GQA_RULES = ("head", "group")


@dataclass
class Quest(Policy):
    """Read the current page, and the pages whose key bound says they could matter, each decode step.

    Quest (the reference's ``evaluation/quest_attention.py`` and ``quest/utils/controller.py``) keeps
    the whole KV cache in pages of ``page_size`` consecutive tokens, aligned to the sequence start.
    At each decode step every query head scores each page with the upper bound
    ``sum_i max(q_i min_i, q_i max_i)`` (element-wise key min/max over the page) and reads its top
    pages: ``max(3, B // page_size)`` pages for a token budget ``B`` (``ratio``/``budget``; ``B`` is
    ``floor(context / ratio)``), the current page inside that count. Forwards of more than one
    query (the prefill, a question, a teacher-forced answer) attend densely, and the first
    ``dense_layers`` layers always do.

    In kvzoo that is a selector and a retriever over an archive that deletes nothing: the attended
    tier holds the current page (schedule ``step``: when a page completes, it moves to the archive
    whole, so archived pages stay aligned), and the ``"quest"`` retriever indexes the archive by
    page (min/max in the model's dtype) and fetches each head's top ``max(3, B // page_size) - 1``
    pages (``gqa="head"``: on GQA models the group fetches the union of its heads' pages, each head
    attends only to its own, and the bytes read count the union once). ``retriever="quest"`` takes
    ``page_size`` and ``gqa`` from here.

    Defaults are Quest's: ``page_size=16``, ``dense_layers=2``, per-head selection, no sink kept
    apart from the pages. kvzoo's options: ``gqa="group"`` scores a page per KV group by the max
    over its heads (one page set for the group, fewer bytes); ``sinks=n`` keeps the first ``n``
    rows attended besides the pages (then archived pages start after them). Known deviations: on
    MLA rows the "key" is the 576-dim latent row and the query the absorbed query (the bound holds
    for any vectors; the reference has no MLA); a padded batch's pages count padding slots.
    """

    sinks: int = 0
    page_size: int = 16
    dense_layers: int = 2
    gqa: str = "head"
    retriever: Any = "quest"

    name: ClassVar[str] = "quest"
    summary: ClassVar[str] = "current page attended; each head's top pages by a key min/max bound fetched per step (reference rules)"
    paper: ClassVar[str] = "https://arxiv.org/abs/2406.10774"
    schedule: ClassVar[str] = "step"

    def validate(self) -> None:
        super().validate()
        for field_name, low in (("sinks", 0), ("page_size", 1), ("dense_layers", 0)):
            require_int(getattr(self, field_name), field_name, low)
        if self.gqa not in GQA_RULES:
            raise ValueError(
                f"gqa must be one of {GQA_RULES} ('head': each query head's own top pages, the reference; "
                f"'group': one page set per KV group), got {self.gqa!r}"
            )
        if not self.archive:
            raise ValueError("quest deletes nothing: archive must be True (pages are fetched back from it)")

    def retriever_params(self) -> dict[str, Any]:
        return {"page_size": self.page_size, "gqa": self.gqa}

    def target_rows(self, event, *, budget, resident, block_rows=0, seen=0):
        current = (seen - 1) % self.page_size + 1 if seen else resident  # rows of the page the latest token is in
        attended = min(self.sinks, max(0, seen - current)) + current
        return attended if resident > attended else None

    def rows_between_events(self) -> int:
        return self.page_size  # the current page fills, then moves to the archive whole

    def select(self, rows: RowsView, keep: int) -> torch.Tensor:
        return keep_sinks_and_recent(rows.valid, self.sinks, keep)

    def step_victim(self, rows: RowsView) -> torch.Tensor:
        return sinks_and_recent_victim(rows.slots, rows.valid, self.sinks)


@dataclass
class QuestRetriever(Retriever):
    """Pages of ``page_size`` consecutive archived rows with element-wise key min/max per page.

    Each decode query picks, per query head (``gqa="head"``) or per KV group by the max over its
    heads (``gqa="group"``), its top ``pages`` pages (default ``max(3, budget // page_size) - 1``
    with the layer's budget: Quest's page count, the current page inside it). The last page may
    be partial. Page min/max are kept in the keys' dtype (each is one of the page's key values).
    On MLA rows the "key" is the whole 576-dim latent row and the query the absorbed query.
    """

    page_size: int = 16
    pages: int | None = None
    gqa: str = "head"

    name: ClassVar[str] = "quest"

    def __post_init__(self) -> None:
        super().__post_init__()
        require_int(self.page_size, "page_size", 1, "rows per page")
        if self.pages is not None:
            require_int(self.pages, "pages", 1, "pages fetched per step; None: from the budget")
        if self.gqa not in GQA_RULES:
            raise ValueError(f"gqa must be one of {GQA_RULES}, got {self.gqa!r}")

    def new_state(self, geometry: RowGeometry) -> PageIndex:
        return PageIndex(self, geometry.capacity)


class PageIndex(RetrievalState):
    """One index row per page of ``page_size`` archived rows, ``[max, min, max|k|]`` (``kernels/index_scan.py``).

    The last page may be partial: its row is updated in place as rows join it. A page of padding
    rows only keeps ``max = -inf``, ``min = +inf`` and is flagged empty (never fetched).
    """

    needs_best = False

    def __init__(self, config: QuestRetriever, capacity: int | None = None) -> None:
        self.config = config
        self.page_size = config.page_size
        self.capacity = capacity  # rows: with a fixed capacity the pages are preallocated and scanned whole
        self.pages = RowStore()  # "entries" [B, G, p, 2 D + 1] in the keys' dtype, "empty" [B, G, p] bool
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

    def index(self, rows, block_keys, block_valid, archive) -> None:
        size = self.page_size
        new = rows["keys"].float()
        valid = rows["valid"]
        lo = new.masked_fill(~valid[..., None], float("inf"))  # padding rows never widen a page
        hi = new.masked_fill(~valid[..., None], float("-inf"))
        B, G, k, D = new.shape
        if not self.pages.buffers:
            dtype = rows["keys"].dtype  # min/max/|max| are key values: exact in the keys' dtype
            pages = -(-self.capacity // size) if self.capacity is not None else 0  # unused pages are empty
            self.pages.define(B, G, {"entries": ((2 * D + 1,), dtype), "empty": ((), torch.bool)}, new.device,
                              capacity=pages, fixed=self.capacity is not None, empty={"empty": True})
        if self.rows % size:  # the last page is partial: merge the new rows into its index row
            fill = min(size - self.rows % size, k)
            last = self.pages.get("entries")[:, :, -1]  # [B, G, 2 D + 1], a view: updated in place
            last[..., :D] = torch.maximum(last[..., :D].float(), hi[:, :, :fill].amax(2))
            last[..., D : 2 * D] = torch.minimum(last[..., D : 2 * D].float(), lo[:, :, :fill].amin(2))
            magnitude = new[:, :, :fill].abs().masked_fill(~valid[:, :, :fill, None], 0).amax(dim=(2, 3))
            last[..., -1] = torch.maximum(last[..., -1].float(), magnitude)
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
            entries = torch.cat([hi, lo, magnitude], dim=-1).to(self.pages.buffers["entries"].dtype)
            self.pages.append({"entries": entries, "empty": empty})
            self.rows += k

    def entries(self) -> int:
        return self.pages.n

    def bounds(self, query: torch.Tensor, scaling: float) -> torch.Tensor:
        B, H, q_len, _ = query.shape
        entries = self.pages.reading("entries")  # a fixed index: every page, the unused ones empty
        G = entries.shape[1]
        bounds = index_scan(page_query(query, G), entries, scaling)  # [B, G, hpg * q, p]
        bounds = bounds.masked_fill(self.pages.reading("empty")[:, :, None], float("-inf"))  # empty pages: never
        return bounds.view(B, H, q_len, -1)

    def n_pages(self, budget: int | None) -> int:
        """Archived pages one query head reads: Quest's ``max(3, B // page_size)`` less the current page."""
        wanted = self.config.pages or max(3, (budget or 0) // self.page_size) - 1
        return min(self.pages.capacity if self.pages.fixed else self.pages.n, wanted)

    def choose(self, query, best, scaling, archive) -> Choice:
        G = archive.keys.shape[1]
        n = self.n_pages(archive.budget)
        size = self.page_size
        offsets = torch.arange(size, device=query.device)
        B = query.shape[0]

        def page_rows(pages: torch.Tensor) -> torch.Tensor:  # [B, *, q, n] page indices -> [B, G, K] rows
            return (pages[..., None] * size + offsets).view(B, G, -1)

        if self.config.gqa == "group":  # one page set per KV group: the max over its heads
            if query.shape[2] == 1:  # a decode step: one fused scan reduced over the heads
                group_max = index_scan_reduce(page_query(query, G), self.pages.reading("entries"), scaling, None)
                group_max = group_max.masked_fill(self.pages.reading("empty"), float("-inf"))  # empty pages: never
                pages = group_max.topk(n, dim=-1).indices[:, :, None]  # [B, G, 1, n]
            else:
                bounds = self.bounds(query, scaling)  # [B, H, q, p]
                H, q_len, p = bounds.shape[1:]
                pages = bounds.view(B, G, H // G, q_len, p).amax(dim=2).topk(n, dim=-1).indices  # [B, G, q, n]
            rows = page_rows(pages)
            return Choice(rows=rows.clamp(max=self.rows - 1), ok=rows < self.rows)
        bounds = self.bounds(query, scaling)  # [B, H, q, p]
        H, q_len, p = bounds.shape[1:]
        pages = bounds.topk(n, dim=-1).indices  # [B, H, q, n]: each head's own pages
        rows = page_rows(pages)  # the union over the group's heads

        def visible(staged: torch.Tensor) -> torch.Tensor:
            """Head h reads a staged row when the row's page is among head h's pages: ``[B, H, K]``."""
            own = torch.zeros(B, H, p, dtype=torch.bool, device=pages.device)
            own.scatter_(2, pages.view(B, H, q_len * n), True)
            return own.gather(2, (staged // size).repeat_interleave(H // G, dim=1))

        return Choice(rows=rows.clamp(max=self.rows - 1), ok=rows < self.rows, visible=visible)

    def select_batch(self, index: torch.Tensor) -> None:
        self.pages.select_batch(index)

    def repeat_batch(self, repeats: int) -> None:
        self.pages.repeat_batch(repeats)
