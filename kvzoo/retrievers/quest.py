"""Quest's retriever: pages of archived rows with element-wise key min/max, each query head's top pages per step.

Tang et al., "Quest: Query-Aware Sparsity for Efficient Long-Context LLM Inference", ICML 2024,
https://arxiv.org/abs/2406.10774 (reference code: github.com/mit-han-lab/Quest). The policy is
``kvzoo/policies/quest.py``; this is its index, usable under any selector (``retriever="quest"``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from kvzoo.framework.policy import require_int
from kvzoo.framework.retriever import Choice, RetrievalState, Retriever, RowGeometry
from kvzoo.kernels.choose import quest_choose, quest_page_add
from kvzoo.kernels.index_scan import index_scan, page_entries, page_query
from kvzoo.retrievers.pages import PageSummary

GQA_RULES = ("head", "group")
RULES = ("eval", "kernel")


def check_paging(page_size: Any, gqa: Any, rule: Any) -> None:
    """The checks of Quest's paging settings, wherever they are given (the policy's fields, the retriever's)."""
    require_int(page_size, "page_size", 1, "rows per page")
    if gqa not in GQA_RULES:
        raise ValueError(
            f"gqa must be one of {GQA_RULES} ('head': each query head's own top pages, the reference; "
            f"'group': one page set per KV group), got {gqa!r}"
        )
    if rule not in RULES:
        raise ValueError(
            f"rule must be one of {RULES} ('eval': the reference's evaluation code, min(max(3, B // page_size), "
            f"pages) pages over all pages, the current page among them; 'kernel': its kernels, the current page "
            f"plus B // page_size - 1 others), got {rule!r}"
        )


@dataclass
class QuestRetriever(Retriever):
    """Pages of ``page_size`` consecutive archived rows with element-wise key min/max per page.

    Each decode query picks, per query head (``gqa="head"``) or per KV group by the max over its
    heads (``gqa="group"``), its top ``pages`` archived pages; by default the count follows ``rule``
    with the layer's budget ``B`` (see :class:`kvzoo.policies.quest.Quest`): ``"eval"`` ``max(3, B // page_size)``
    (the current page is the archive's last page, one of the candidates), ``"kernel"``
    ``B // page_size - 1`` (the current page is attended apart), at most the pages there are. Under
    ``"eval"``, where the policy archives the step's row next (the ``quest`` policy's eval rule: the view carries
    the row, ``ArchiveView.own_row``), a decode step scores the current page with the step's own key in its min/max,
    as the reference does (the key is indexed after the forward; the choice joins it to the open page, or opens one
    with it); under another selector the archive's last page is not the step's, and no row is joined. The
    last page may be partial. Page min/max are kept in the keys' dtype (each is one of the page's key
    values). On MLA rows the "key" is the whole 576-dim latent row and the query the absorbed query.
    Under the ``quest`` policy these settings are the policy's (it names its retriever).
    """

    page_size: int = 16
    pages: int | None = None
    gqa: str = "head"
    rule: str = "eval"

    name: ClassVar[str] = "quest"
    # the reference's other rule (its kernels' page count), and one page set per KV group (the equal-bytes comparison
    # with the reference's per-head sets)
    variants: ClassVar[tuple[str, ...]] = ("rule=kernel", "gqa=group")

    def __post_init__(self) -> None:
        super().__post_init__()
        check_paging(self.page_size, self.gqa, self.rule)
        if self.pages is not None:
            require_int(self.pages, "pages", 1, "pages fetched per step; None: from the budget")

    def archived_pages(self, budget: int | None) -> int:
        """Archived pages one query head reads per decode step for a layer budget of ``budget`` rows (before the
        cap at the pages there are): ``pages`` when given, else the rule's count."""
        if self.pages is not None:
            return self.pages
        per_budget = (budget or 0) // self.page_size
        return max(3, per_budget) if self.rule == "eval" else max(0, per_budget - 1)

    def new_state(self, geometry: RowGeometry) -> PageIndex:
        return PageIndex(self, geometry.capacity)


def _quest_entries(lo: torch.Tensor, hi: torch.Tensor, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Quest's page entries ``[max, min, max |k|]`` (:func:`~kvzoo.kernels.index_scan.page_entries`) in the keys'
    dtype (each is one of the page's key values: exact); an empty page's magnitude is 0."""
    empty = torch.isinf(lo).all(-1, keepdim=True)
    entries = page_entries(lo, hi)
    entries[..., -1:] = entries[..., -1:].masked_fill(empty, 0.0)
    return {"entries": entries.to(dtype)}


class PageIndex(RetrievalState):
    """One index row per page of ``page_size`` archived rows, ``[max, min, max|k|]`` (``kernels/index_scan.py``), in
    a :class:`~kvzoo.retrievers.pages.PageSummary`.

    The last page may be partial: its row is rewritten as rows join it. A page of padding rows only keeps
    ``max = -inf``, ``min = +inf`` and is flagged empty (never fetched).
    """

    needs_best = False

    def __init__(self, config: QuestRetriever, capacity: int | None = None) -> None:
        self.config = config
        self.page_size = config.page_size
        self.summary = PageSummary(config.page_size, _quest_entries, capacity)

    @property
    def pages(self):
        """The encoded pages (a :class:`~kvzoo.framework.buffers.RowStore`: ``entries``, ``empty``)."""
        return self.summary.pages

    @property
    def rows(self) -> int:
        return self.summary.rows

    @property
    def count(self) -> torch.Tensor | None:
        return self.summary.count

    @property
    def entry_bytes(self) -> int:  # type: ignore[override]
        entries = self.summary.pages.buffers.get("entries")
        if entries is None:  # not defined yet
            return 0
        return entries.shape[-1] * entries.element_size()

    def _live_entries(self) -> torch.Tensor:
        return self.summary.reading("entries")[:, :, : self.summary.live_pages]

    @property
    def page_min(self) -> torch.Tensor:
        """Element-wise minimum of each page's keys ``[B, G, p, D]`` (+inf for an empty page)."""
        entries = self._live_entries()
        D = (entries.shape[-1] - 1) // 2
        return entries[..., D : 2 * D]

    @property
    def page_max(self) -> torch.Tensor:
        """Element-wise maximum of each page's keys ``[B, G, p, D]`` (-inf for an empty page)."""
        entries = self._live_entries()
        D = (entries.shape[-1] - 1) // 2
        return entries[..., :D]

    def index(self, rows, tier, archive) -> None:
        keys = rows["keys"]
        D = keys.shape[-1]
        self.summary.add(keys, rows["valid"], {"entries": ((2 * D + 1,), keys.dtype)})

    def index_in_place(self, storage, positions) -> bool:
        """One row a step (``rule="eval"`` archives each decode step's row) joins the summary in one op,
        :func:`~kvzoo.kernels.choose.quest_page_add`, read where it lies; the host's counts move in the summary
        (:meth:`~kvzoo.retrievers.pages.PageSummary.one_added`)."""
        summary = self.summary
        if positions.shape[2] != 1 or not summary.room_for_one():
            return False
        pages = summary.pages
        quest_page_add(storage["keys"], storage["valid"], positions[:, :, 0], summary.open_min, summary.open_max,
                       pages.buffers["entries"], pages.buffers["empty"], summary.count, pages.length, self.page_size)
        summary.one_added()
        return True

    def entries(self) -> int:
        """Index entries one scan reads: the live pages, or every page slot of a fixed index."""
        pages = self.summary.pages
        return pages.capacity if pages.fixed else pages.n

    def bounds(self, query: torch.Tensor, scaling: float) -> torch.Tensor:
        B, H, q_len, _ = query.shape
        entries = self.summary.reading("entries")  # a fixed index: every page, the unused ones empty
        G = entries.shape[1]
        bounds = index_scan(page_query(query, G), entries, scaling)  # [B, G, hpg * q, p]
        bounds = bounds.masked_fill(self.summary.reading("empty")[:, :, None], float("-inf"))  # empty: never
        return bounds.view(B, H, q_len, -1)

    def n_pages(self, budget: int | None, own: bool = False) -> int:
        """Archived pages one query head reads (:meth:`QuestRetriever.archived_pages`), at most the index's pages
        (with a fixed capacity: its page slots; those past the archive are empty and never fetched), one more when
        the step's own row is scored with the current page (``own``: the page it opens may be past them)."""
        return min(self.summary.entries() + own, self.config.archived_pages(budget))

    def _own(self, archive) -> tuple[torch.Tensor, ...] | None:
        """``rule="eval"``: the step's own row and the open page's running min/max, for the choice to score the
        current page with the step's key in it, as the reference evaluation code does (its new key joins the key
        states before any page is scored); None elsewhere (``rule="kernel"`` attends the current page apart; a view
        without the row: the policy does not archive it next)."""
        row = archive.own_row if self.config.rule == "eval" else None
        if row is None or not self.summary.pages.buffers:  # the summary not defined yet
            return None
        return (*row, self.summary.open_min, self.summary.open_max)

    def choose(self, query, best, scaling, archive) -> Choice:
        G = archive.groups
        size = self.page_size
        own = self._own(archive) if query.shape[2] == 1 else None
        n = self.n_pages(archive.budget, own is not None)
        B = query.shape[0]
        if n == 0:  # the kernel rule with B < 2 pages: the current page only, no archived page read
            none = torch.zeros(B, G, 1, dtype=torch.long, device=query.device)
            return Choice(rows=none, ok=torch.zeros_like(none, dtype=torch.bool))

        def page_rows(pages: torch.Tensor) -> torch.Tensor:  # [B, *, q, n] page indices -> [B, G, K] rows
            return (pages[..., None] * size + torch.arange(size, device=pages.device)).view(B, G, -1)

        per_head = self.config.gqa == "head"
        if query.shape[2] == 1:  # a decode step: one op (kernels/choose.py) from the query to the rows and their count
            H, D = query.shape[1], query.shape[3]
            counter = archive.fetched
            rows, positions, ok, count = quest_choose(
                query.float().reshape(B, G, H // G, D), self.summary.pages.reading("entries"),
                self.summary.pages.reading("empty"),
                self.summary.count, archive.positions, n, size, archive.rows, scaling, per_head=per_head,
                counter=counter, own=own)
            if per_head:  # each head reads its own segment (no union to stage); the group's union counted once
                return Choice(rows=rows, ok=ok, segments=True, count=count, positions=positions,
                              counted=counter is not None)
            return Choice(staged=(rows, ok), count=count, positions=positions, counted=counter is not None)
        if not per_head:  # one page set per KV group: the max over its heads
            bounds = self.bounds(query, scaling)  # [B, H, q, p]
            H, q_len, p = bounds.shape[1:]
            pages = bounds.view(B, G, H // G, q_len, p).amax(dim=2).topk(n, dim=-1).indices  # [B, G, q, n]
            rows = page_rows(pages)
            return Choice(rows=self._clamped(rows), ok=rows < self._live())
        bounds = self.bounds(query, scaling)  # [B, H, q, p]
        H, q_len, p = bounds.shape[1:]
        pages = bounds.topk(n, dim=-1).indices  # [B, H, q, n]: each head's own pages
        rows = page_rows(pages)  # [B, G, heads x queries x n x size]: each head's rows, head after head

        def visible(staged: torch.Tensor) -> torch.Tensor:
            """Head h reads a staged row when the row's page is among head h's pages: ``[B, H, K]``."""
            own = torch.zeros(B, H, p, dtype=torch.bool, device=pages.device)
            own.scatter_(2, pages.view(B, H, q_len * n), True)
            # a staged row past the pages (an unchosen candidate clamped to the archive list's end, which may have
            # grown past a fixed index) is never picked: any page will do
            return own.gather(2, (staged // size).clamp_(max=p - 1).repeat_interleave(H // G, dim=1))

        return Choice(rows=self._clamped(rows), ok=rows < self._live(), visible=visible)

    def _live(self) -> int | torch.Tensor:
        """Rows indexed: the device count for a fixed index (a decode step's ops do not depend on it), else the
        host's."""
        return self.summary.count if self.summary.fixed else self.summary.rows

    def _clamped(self, rows: torch.Tensor) -> torch.Tensor:
        live = self._live()
        return torch.minimum(rows, live - 1) if isinstance(live, torch.Tensor) else rows.clamp(max=live - 1)

    def select_batch(self, index: torch.Tensor) -> None:
        self.summary.select_batch(index)

    def repeat_batch(self, repeats: int) -> None:
        self.summary.repeat_batch(repeats)
