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
from kvzoo.framework.policy import SinksAndRecentPolicy, require_int
from kvzoo.framework.retriever import Choice, RetrievalState, Retriever, RowGeometry
from kvzoo.kernels.index_scan import index_scan, index_scan_reduce, page_query

GQA_RULES = ("head", "group")


RULES = ("eval", "kernel")


@dataclass
class Quest(SinksAndRecentPolicy):
    """Read the pages whose key bound says they could matter, each decode step; nothing is deleted.

    Quest keeps the whole KV cache in pages of ``page_size`` consecutive tokens, aligned to the sequence
    start. At each decode step every query head scores each page with the upper bound
    ``sum_i max(q_i min_i, q_i max_i)`` (element-wise key min/max over the page) and reads its top pages.
    How many, and whether the current page (the one the step's own token is in) is forced, the reference
    says two ways, and both are here by name (``rule``; ``B`` is the token budget, ``floor(context /
    ratio)`` or ``budget``):

    * ``rule="eval"`` (default) -- the reference's evaluation code, ``evaluation/quest_attention.py``
      (``local_heavy_hitter_mask``), which produced the paper's accuracy figures (LongBench, passkey,
      PG19): ``min(max(3, B // page_size), pages)`` pages chosen over *all* pages, the current page among
      them like any other -- read when its bound ranks, not forced. In kvzoo every row but the sinks moves to
      the archive after each forward, so the current page is the archive's last (partial) page and competes
      there; the step's own row is the one row the runtime attends apart (its attended tier).
    * ``rule="kernel"`` -- the reference's kernels and model code (``quest/utils/controller.py``,
      ``quest/models/llama.py``), which produced its latency figures: ``page_budget = B // page_size``, the
      current (last) page always read, and the top ``min(page_budget, pages) - 1`` of the other pages; no
      ``max(3, .)`` (``B < 2 * page_size`` reads the current page only). In kvzoo the attended tier holds
      exactly the current page (when a page completes it moves to the archive whole).

    The default is ``"eval"``: kvzoo's leaderboard measures quality, and the paper's quality figures come
    from the evaluation code; the kernel rule is what its speed figures ran (both rows are on the leaderboard).
    Both read multi-token forwards (the prefill, a question, a teacher-forced answer) densely, as both the
    reference's paths do, and the first ``dense_layers`` layers always densely.

    Known deviations: ``rule="eval"`` -- the step's own row is always read by every head (the reference reads
    it only when the current page ranks among a head's pages), and the current page's bound leaves out that
    row's key (the page's other rows are in the index; the step's row is indexed after its forward); at a
    step that opens a page the current page therefore holds no indexed row, and the head reads ``n`` other
    pages where the reference reads ``n`` pages counting the 1-row current page. On MLA rows the "key" is the
    576-dim latent row and the query the absorbed query (the bound holds for any vectors; the reference has
    no MLA); a padded batch's pages count padding slots; the bound carries a float slack
    (``kernels/index_scan.py``: ``1e-5 * ||q||_1 * max|k|`` per page, so that fp32 rounding never makes it
    undercut an exact score; the reference has none).

    The ``"quest"`` retriever indexes the archive by page (min/max in the model's dtype) and fetches each
    head's pages (``gqa="head"``: on GQA models the group fetches the union of its heads' pages, each head
    attends only to its own, and the bytes read count the union once); ``retriever="quest"`` takes
    ``page_size``, ``gqa`` and ``rule`` from here. Defaults are Quest's: ``page_size=16``,
    ``dense_layers=2``, per-head selection, no sink kept apart from the pages. kvzoo's options:
    ``gqa="group"`` scores a page per KV group by the max over its heads (one page set for the group, fewer
    bytes); ``sinks=n`` keeps the first ``n`` rows attended besides the pages (then archived pages start
    after them).
    """

    sinks: int = 0
    page_size: int = 16
    dense_layers: int = 2
    gqa: str = "head"
    rule: str = "eval"
    retriever: Any = "quest"

    name: ClassVar[str] = "quest"
    summary: ClassVar[str] = ("each head's top pages by a key min/max bound read per step; rule='eval' (default: the "
                              "reference's evaluation code) or 'kernel' (its kernels)")
    paper: ClassVar[str] = "https://arxiv.org/abs/2406.10774"
    schedule: ClassVar[str] = "step"

    def validate(self) -> None:
        super().validate()
        for field_name, low in (("page_size", 1), ("dense_layers", 0)):
            require_int(getattr(self, field_name), field_name, low)
        if self.gqa not in GQA_RULES:
            raise ValueError(
                f"gqa must be one of {GQA_RULES} ('head': each query head's own top pages, the reference; "
                f"'group': one page set per KV group), got {self.gqa!r}"
            )
        check_rule(self.rule)
        if not self.archive:
            raise ValueError("quest deletes nothing: archive must be True (pages are fetched back from it)")

    def retriever_params(self) -> dict[str, Any]:
        return {"page_size": self.page_size, "gqa": self.gqa, "rule": self.rule}

    def target_rows(self, event, *, budget, resident, block_rows=0, seen=0):
        sinks = min(self.sinks, seen if seen else resident)
        if self.rule == "eval":  # every row but the sinks is archived: the current page competes from the index
            attended = sinks
        else:  # kernel: the current page stays attended; a completed page moves to the archive at once
            current = (seen - sinks) % self.page_size if seen else resident - sinks
            attended = sinks + current
        return attended if resident > attended else None

    def rows_between_events(self) -> int:
        return self.page_size if self.rule == "kernel" else 1  # eval: each forward's rows leave after it


def check_rule(rule: Any) -> None:
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
    with the layer's budget ``B`` (see :class:`Quest`): ``"eval"`` ``max(3, B // page_size)`` (the
    current page is the archive's last page, one of the candidates), ``"kernel"``
    ``B // page_size - 1`` (the current page is attended apart), at most the pages there are. The
    last page may be partial. Page min/max are kept in the keys' dtype (each is one of the page's key
    values). On MLA rows the "key" is the whole 576-dim latent row and the query the absorbed query.
    """

    page_size: int = 16
    pages: int | None = None
    gqa: str = "head"
    rule: str = "eval"

    name: ClassVar[str] = "quest"

    def __post_init__(self) -> None:
        super().__post_init__()
        require_int(self.page_size, "page_size", 1, "rows per page")
        if self.pages is not None:
            require_int(self.pages, "pages", 1, "pages fetched per step; None: from the budget")
        if self.gqa not in GQA_RULES:
            raise ValueError(f"gqa must be one of {GQA_RULES}, got {self.gqa!r}")
        check_rule(self.rule)

    def archived_pages(self, budget: int | None) -> int:
        """Archived pages one query head reads per decode step for a layer budget of ``budget`` rows (before the
        cap at the pages there are): ``pages`` when given, else the rule's count."""
        if self.pages is not None:
            return self.pages
        per_budget = (budget or 0) // self.page_size
        return max(3, per_budget) if self.rule == "eval" else max(0, per_budget - 1)

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
        self.count: torch.Tensor | None = None  # the same on the device, int64 [1] (what a fixed index's steps read)
        self._blank: torch.Tensor | None = None  # a page with no row yet: [max = -inf, min = +inf, max|k| = 0]

    @property
    def entry_bytes(self) -> int:  # type: ignore[override]
        if not self.pages.buffers:
            return 0
        entries = self.pages.buffers["entries"]
        return entries.shape[-1] * entries.element_size()

    @property
    def live_pages(self) -> int:
        """Pages holding some indexed row (the last may be partial)."""
        return -(-self.rows // self.page_size)

    def _live_entries(self) -> torch.Tensor:
        return self.pages.reading("entries")[:, :, : self.live_pages]

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
            self.count = torch.zeros(1, dtype=torch.long, device=new.device)
            inf = torch.full((D,), float("inf"), device=new.device)
            self._blank = torch.cat([-inf, inf, inf.new_zeros(1)])
        if k == 1 and self.pages.fixed and self.rows < self.pages.capacity * size:
            self._index_one(new, hi, lo, valid)
            return
        if self.pages.n != self.live_pages:  # after single rows (_index_one leaves the host's page count)
            self.pages.n = self.live_pages
            self.pages.length.fill_(self.pages.n)
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
        self.count.fill_(self.rows)

    def _index_one(self, new: torch.Tensor, hi: torch.Tensor, lo: torch.Tensor, valid: torch.Tensor) -> None:
        """One row (``[B, G, 1, D]``) joins a fixed index -- Quest's ``rule="eval"`` archives each decode step's
        row -- with the same ops whether it opens a page or joins the open one: its page is found from the device
        count, read, merged (a new page merges into the blank entry) and written back. The host's page count
        (``pages.n``) is left as it is -- a number that jumped every ``page_size`` steps could not be carried by a
        replayed CUDA graph (``framework/graphs.py`` extrapolates host numbers) -- and brought up to date by the
        next multi-row index; a fixed index is scanned whole anyway (:meth:`entries`)."""
        size = self.page_size
        page = torch.div(self.count, size, rounding_mode="floor")  # [1], on the device
        entries, empty = self.pages.buffers["entries"], self.pages.buffers["empty"]
        opens = (self.count % size == 0).view(1, 1, 1, 1)
        current = torch.where(opens, self._blank, entries.index_select(2, page).float())  # [B, G, 1, 2 D + 1]
        D = new.shape[-1]
        magnitude = new.abs().masked_fill(~valid[..., None], 0).amax(-1, keepdim=True)
        merged = torch.cat([torch.maximum(current[..., :D], hi), torch.minimum(current[..., D : 2 * D], lo),
                            torch.maximum(current[..., -1:], magnitude)], dim=-1)
        entries.index_copy_(2, page, merged.to(entries.dtype))
        was_empty = torch.where(opens[..., 0], True, empty.index_select(2, page))
        empty.index_copy_(2, page, was_empty & ~valid)
        self.count.add_(1)
        self.rows += 1
        self.pages.length.copy_(torch.div(self.count + (size - 1), size, rounding_mode="floor"))

    def entries(self) -> int:
        """Index entries one scan reads: the live pages, or every page slot of a fixed index (its scan reads the
        whole buffer, the unused pages flagged empty: :meth:`bounds` passes no length)."""
        return self.pages.capacity if self.pages.fixed else self.pages.n

    def bounds(self, query: torch.Tensor, scaling: float) -> torch.Tensor:
        B, H, q_len, _ = query.shape
        entries = self.pages.reading("entries")  # a fixed index: every page, the unused ones empty
        G = entries.shape[1]
        bounds = index_scan(page_query(query, G), entries, scaling)  # [B, G, hpg * q, p]
        bounds = bounds.masked_fill(self.pages.reading("empty")[:, :, None], float("-inf"))  # empty pages: never
        return bounds.view(B, H, q_len, -1)

    def n_pages(self, budget: int | None) -> int:
        """Archived pages one query head reads (:meth:`QuestRetriever.archived_pages`), at most the index's pages
        (with a fixed capacity: its page slots; those past the archive are empty and never fetched)."""
        wanted = self.config.archived_pages(budget)
        return min(self.pages.capacity if self.pages.fixed else self.pages.n, wanted)

    def choose(self, query, best, scaling, archive) -> Choice:
        G = archive.keys.shape[1]
        n = self.n_pages(archive.budget)
        size = self.page_size
        offsets = torch.arange(size, device=query.device)
        B = query.shape[0]
        if n == 0:  # the kernel rule with B < 2 pages: the current page only, no archived page read
            none = torch.zeros(B, G, 1, dtype=torch.long, device=query.device)
            return Choice(rows=none, ok=torch.zeros_like(none, dtype=torch.bool))

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
            return Choice(rows=self._clamped(rows), ok=rows < self._live())
        bounds = self.bounds(query, scaling)  # [B, H, q, p]
        H, q_len, p = bounds.shape[1:]
        pages = bounds.topk(n, dim=-1).indices  # [B, H, q, n]: each head's own pages
        rows = page_rows(pages)  # the union over the group's heads

        def visible(staged: torch.Tensor) -> torch.Tensor:
            """Head h reads a staged row when the row's page is among head h's pages: ``[B, H, K]``."""
            own = torch.zeros(B, H, p, dtype=torch.bool, device=pages.device)
            own.scatter_(2, pages.view(B, H, q_len * n), True)
            return own.gather(2, (staged // size).repeat_interleave(H // G, dim=1))

        return Choice(rows=self._clamped(rows), ok=rows < self._live(), visible=visible)

    def _live(self) -> int | torch.Tensor:
        """Rows indexed: the device count for a fixed index (a decode step's ops do not depend on it), else the
        host's."""
        return self.count if self.pages.fixed else self.rows

    def _clamped(self, rows: torch.Tensor) -> torch.Tensor:
        live = self._live()
        return torch.minimum(rows, live - 1) if isinstance(live, torch.Tensor) else rows.clamp(max=live - 1)

    def select_batch(self, index: torch.Tensor) -> None:
        self.pages.select_batch(index)

    def repeat_batch(self, repeats: int) -> None:
        self.pages.repeat_batch(repeats)
