"""``quest``: query-aware page selection over an archive that deletes nothing.

Tang et al., "Quest: Query-Aware Sparsity for Efficient Long-Context LLM Inference", ICML 2024,
https://arxiv.org/abs/2406.10774 (reference code: github.com/mit-han-lab/Quest).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from kvzoo.framework.policy import Policy, RowsView, keep_sinks_and_recent, require_int
from kvzoo.framework.retrieval import Choice, RetrievalState, Retriever
from kvzoo.kernels.index_scan import page_bounds

if TYPE_CHECKING:
    from kvzoo.framework.cache import TieredLayer


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


@dataclass
class QuestRetriever(Retriever):
    """Pages of ``page_size`` consecutive archived rows with element-wise key min/max per page.

    Each forward fetches the top ``pages`` pages per KV group (default ``ceil(budget / page_size)``
    with the layer's budget), scored by the max over the group's query heads and the forward's
    queries of Quest's bound. The last page may be partial. On MLA rows the "key" is the whole
    576-dim latent row and the query the absorbed query (the bound holds for any vectors).
    """

    page_size: int = 16
    pages: int | None = None

    name: ClassVar[str] = "quest"

    def __post_init__(self) -> None:
        require_int(self.page_size, "page_size", 1, "rows per page")
        if self.pages is not None and (not isinstance(self.pages, int) or self.pages < 1):
            raise ValueError(f"pages must be None (from the budget) or an int >= 1, got {self.pages!r}")

    def new_state(self, layer: TieredLayer) -> PageIndex:
        return PageIndex(self)


class PageIndex(RetrievalState):
    def __init__(self, config: QuestRetriever) -> None:
        self.config = config
        self.page_min: torch.Tensor | None = None  # [B, G, p, D]
        self.page_max: torch.Tensor | None = None
        self.rows = 0  # archived rows indexed

    def index(self, layer: TieredLayer, rows: dict[str, torch.Tensor], block_keys: torch.Tensor) -> None:
        size = self.config.page_size
        new = rows["keys"].float()
        valid = rows["valid"]
        lo = new.masked_fill(~valid[..., None], float("inf"))  # padding rows never widen a page
        hi = new.masked_fill(~valid[..., None], float("-inf"))
        if self.rows % size:  # the last page is partial: merge the new rows into it first
            fill = min(size - self.rows % size, new.shape[2])
            self.page_min[:, :, -1] = torch.minimum(self.page_min[:, :, -1], lo[:, :, :fill].amin(2))
            self.page_max[:, :, -1] = torch.maximum(self.page_max[:, :, -1], hi[:, :, :fill].amax(2))
            lo, hi = lo[:, :, fill:], hi[:, :, fill:]
            self.rows += fill
        k = lo.shape[2]
        if k:
            pages = math.ceil(k / size)
            pad = pages * size - k
            B, G, _, D = lo.shape
            lo = torch.cat([lo, lo.new_full((B, G, pad, D), float("inf"))], 2).view(B, G, pages, size, D).amin(3)
            hi = torch.cat([hi, hi.new_full((B, G, pad, D), float("-inf"))], 2).view(B, G, pages, size, D).amax(3)
            self.page_min = lo if self.page_min is None else torch.cat([self.page_min, lo], 2)
            self.page_max = hi if self.page_max is None else torch.cat([self.page_max, hi], 2)
            self.rows += k

    def choose(self, layer, query, q_slots, scaling, best_attended) -> Choice:  # noqa: ANN001
        size = self.config.page_size
        # an all-padding page has min=+inf / max=-inf: treat it as empty (bound -inf)
        empty = torch.isinf(self.page_min).all(-1)  # [B, G, p]
        lo = self.page_min.masked_fill(empty[..., None], 0.0)
        hi = self.page_max.masked_fill(empty[..., None], 0.0)
        bounds = page_bounds(query, lo, hi, scaling)  # [B, H, q, p]
        B, H, q_len, p = bounds.shape
        G = lo.shape[1]
        bounds = bounds.masked_fill(empty.repeat_interleave(H // G, 1)[:, :, None, :], float("-inf"))
        group_score = bounds.view(B, G, H // G, q_len, p).amax(dim=(2, 3))  # [B, G, p]
        budget = layer.budget or 0
        n_pages = min(p, self.config.pages or max(1, math.ceil(budget / size)))
        top = group_score.topk(n_pages, dim=-1).indices
        chosen_pages = torch.zeros(B, G, p, dtype=torch.bool, device=bounds.device).scatter_(-1, top, True)
        mask = chosen_pages.repeat_interleave(size, dim=-1)[..., : self.rows]
        D = lo.shape[-1]
        return Choice(
            mask=mask, bounds=bounds, entries_scanned=p, entry_bytes=2 * D * 4, audit_top=n_pages * size,
            page_size=size,
        )
