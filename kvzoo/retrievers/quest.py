"""Quest's retriever (Tang et al., ICML 2024, https://arxiv.org/abs/2406.10774; github.com/mit-han-lab/Quest): pages
of archived rows with element-wise key min/max, each query head's top pages per step, under any selector. Its page
summary (:class:`PageSummary`) is also the coarse level of VestigeKV's paged int8 index.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from kvzoo.framework.buffers import RowStore
from kvzoo.framework.policy import require_int
from kvzoo.framework.retriever import Choice, RetrievalState, Retriever, RowGeometry
from kvzoo.kernels.choose import quest_choose, quest_page_add, quest_page_entries
from kvzoo.kernels.index_scan import index_scan, page_query

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
    """Pages of ``page_size`` consecutive archived rows with element-wise key min/max per page (in the keys' dtype;
    on MLA rows the "key" is the whole latent row). Each decode query picks, per query head (``gqa="head"``) or per KV
    group (``gqa="group"``), its top ``pages`` archived pages, by default as many as ``rule`` and the layer's budget
    give (:meth:`archived_pages`; :class:`kvzoo.policies.quest.Quest` says why). Under ``"eval"`` a decode step
    scores the current page with the step's own key in its min/max, as the reference does.
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


# --- the page summary ------------------------------------------------------------------------------------------------
# Pages are ``page_size`` consecutive archived rows (in archive order); per page the summary keeps each key dimension's
# minimum and maximum over the page's valid rows, encoded by its user (Quest stores ``[max, min, max |k|]`` in the
# keys' dtype, exact; the paged int8 index int8 codes with one scale), and an ``empty`` flag (a page of padding rows
# only: never fetched). The last page may be open (partial): its running min/max are kept in fp32 beside the encoded
# pages, so a row joining it re-encodes it from exact numbers. One row joining a fixed-capacity summary (a per-step
# archive, e.g. Quest's ``rule="eval"``) is written with the same ops whether it opens a page or joins the open one,
# its page found from the device count, so that a captured decode step replays it; the host's page count is brought
# up to date by the next multi-row add.
# Pages are aligned to each sequence's first real row, as Quest's pages are to the sequence start: where the storage
# may hold padding (a left-padded batch), each (sequence, group) keeps a ``shift`` of virtual rows before its archive,
# set when its first real row is summarised so that this row opens a page; row ``r`` is then in page
# ``(r + shift) // page_size`` and the padding ahead of it in pages of their own (empty). Without padding when the
# summary is defined (its first rows) no shift is kept: every page starts at a multiple of ``page_size``. Quest's choice
# takes the shifts (its C op too); a row a step joins a shifted summary through ``_add_one`` (torch ops: the one-row
# C op's pages are aligned at row 0); a fixed summary with shifts has one page slot more.

Encode = Callable[[torch.Tensor, torch.Tensor, torch.dtype], dict[str, torch.Tensor]]  # (lo, hi, keys' dtype)


class PageSummary:
    """The encoded pages ``[B, G, p, ...]`` of a layer's archive, their ``empty`` flags, and the open page's running
    min/max (above). ``fields`` names the encoded buffers (``name -> (trailing shape, dtype)``)."""

    def __init__(self, page_size: int, encode: Encode, capacity: int | None = None) -> None:
        self.page_size = page_size
        self.encode = encode
        self.capacity = capacity  # archived rows a fixed summary is preallocated for (None: it grows)
        self.pages = RowStore()
        self.rows = 0  # archived rows summarised (host)
        self.count: torch.Tensor | None = None  # the same on the device, int64 [1]
        self.open_min: torch.Tensor | None = None  # [B, G, D] fp32, +inf while the open page is empty
        self.open_max: torch.Tensor | None = None  # [B, G, D] fp32, -inf while empty
        self.dtype: torch.dtype | None = None  # the summarised keys' dtype
        # with padding (above): virtual rows before each archive, [B, G] int64, and whether a real row was summarised
        self.shift: torch.Tensor | None = None
        self.started: torch.Tensor | None = None

    @property
    def live_pages(self) -> int:
        """Pages holding some summarised row (the last may be open; with a shift, at most one page more)."""
        extra = self.page_size - 1 if self.shift is not None and self.rows else 0
        return -(-(self.rows + extra) // self.page_size)

    def entries(self) -> int:
        """Pages one scan reads: the live ones, or every page slot of a fixed summary (scanned whole, the unused
        ones empty)."""
        return self.pages.capacity if self.pages.fixed else self.pages.n

    def page_of(self, rows: torch.Tensor) -> torch.Tensor:
        """The page of each archive row index ``rows [B, G, ...]`` (``[...]``: any; shared by every sequence)."""
        if self.shift is None:
            return torch.div(rows, self.page_size, rounding_mode="floor")
        shift = self.shift.view(*self.shift.shape, *([1] * (rows.dim() - 2))) if rows.dim() >= 2 else self.shift
        return torch.div(rows + shift, self.page_size, rounding_mode="floor")

    def _define(self, keys: torch.Tensor, fields: dict[str, tuple[tuple[int, ...], torch.dtype]],
                padded: bool) -> None:
        B, G, _, D = keys.shape
        pages = -(-self.capacity // self.page_size) + padded if self.capacity is not None else 0
        self.pages.define(B, G, {**fields, "empty": ((), torch.bool)}, keys.device, capacity=pages,
                          fixed=self.capacity is not None, empty={"empty": True})
        self.count = torch.zeros(1, dtype=torch.long, device=keys.device)
        self.dtype = keys.dtype
        self.open_min = torch.full((B, G, D), float("inf"), device=keys.device)
        self.open_max = torch.full((B, G, D), float("-inf"), device=keys.device)
        if padded:
            self._start_shifts()

    def _start_shifts(self) -> None:
        """Keep shifts (each set by its sequence's first real row)."""
        B, G = self.open_min.shape[:2]
        self.shift = torch.zeros(B, G, dtype=torch.long, device=self.open_min.device)
        self.started = torch.zeros(B, G, dtype=torch.bool, device=self.open_min.device)

    def _shift_for(self, valid: torch.Tensor) -> None:
        """Fix the shift of each (sequence, group) whose first real row is among ``valid [B, G, k]`` (the rows joining
        the archive at ``self.rows``): that row opens a page. On the device (no synchronisation)."""
        k = valid.shape[2]
        first = torch.where(valid, torch.arange(k, device=valid.device), k).amin(2)  # [B, G], k: no real row
        fresh = ~self.started & (first < k)
        self.shift.copy_(torch.where(fresh, torch.remainder(-(self.count + first), self.page_size), self.shift))
        self.started |= first < k

    def add(self, keys: torch.Tensor, valid: torch.Tensor,
            fields: dict[str, tuple[tuple[int, ...], torch.dtype]], padded: bool = False) -> None:
        """Summarise archived rows ``keys [B, G, k, D]`` (``valid`` False: padding, which never widens a page) as
        they join the end of the archive. ``fields`` (the encoded buffers' shapes and dtypes) define the summary
        on its first call. ``padded``: the storage may hold padding (pages then start at each sequence's first real
        row: the comment above)."""
        B, G, k, D = keys.shape
        if k == 0:
            return
        if not self.pages.buffers:  # shifts only from a padded first add: rows summarised unpadded were all real
            self._define(keys, fields, padded)  # (every sequence started at row 0, its shift 0 for good)
        x = keys.float()
        lo = x.masked_fill(~valid[..., None], float("inf"))
        hi = x.masked_fill(~valid[..., None], float("-inf"))
        size = self.page_size
        room = self.capacity if self.shift is not None else self.pages.capacity * size
        if k == 1 and self.pages.fixed and self.rows < room:
            self._add_one(lo[:, :, 0], hi[:, :, 0], valid)
            return
        if self.shift is not None:
            self._add_shifted(lo, hi, valid)
            return
        live = self.live_pages
        if self.pages.n != live:  # after single rows (_add_one leaves the host's page count)
            self.pages.n = live
            self.pages.length.fill_(live)
        filled = self.rows % size  # rows already in the open page
        pages = -(-(filled + k) // size)
        pad = pages * size - filled - k
        lo = torch.cat([lo.new_full((B, G, filled, D), float("inf")), lo, lo.new_full((B, G, pad, D), float("inf"))], 2)
        hi = torch.cat([hi.new_full((B, G, filled, D), float("-inf")), hi,
                        hi.new_full((B, G, pad, D), float("-inf"))], 2)
        lo = lo.view(B, G, pages, size, D).amin(3)
        hi = hi.view(B, G, pages, size, D).amax(3)
        if filled:  # the open page's earlier rows
            lo[:, :, 0] = torch.minimum(lo[:, :, 0], self.open_min)
            hi[:, :, 0] = torch.maximum(hi[:, :, 0], self.open_max)
        encoded = self.encode(lo, hi, self.dtype)
        encoded["empty"] = torch.isinf(lo).all(-1) & torch.isinf(hi).all(-1)
        if filled:  # rewrite the open page in place, append the rest
            for name, value in encoded.items():
                self.pages.get(name)[:, :, -1] = value[:, :, 0]
            encoded = {name: value[:, :, 1:] for name, value in encoded.items()}
        if next(iter(encoded.values())).shape[2]:
            self.pages.append(encoded)
        self.open_min.copy_(lo[:, :, -1])
        self.open_max.copy_(hi[:, :, -1])
        self.rows += k
        self.count.fill_(self.rows)

    def _add_one(self, lo: torch.Tensor, hi: torch.Tensor, valid: torch.Tensor) -> None:
        """One row (``[B, G, D]``; ``valid [B, G, 1]``) joins a fixed summary, the same ops whether it opens a page
        or joins the open one (its page found from the device count); the host's page count is left as it is (a
        replayed CUDA graph carries only host numbers that move linearly) and brought up to date by the next
        multi-row add."""
        size = self.page_size
        if self.shift is None:
            at = self.count.view(1, 1)
        else:
            self._shift_for(valid)
            at = self.count + self.shift  # [B, G]: the row's place with its sequence's virtual rows
        page = torch.div(at, size, rounding_mode="floor")  # on the device
        opens = (at % size == 0)[..., None]
        self.open_min.copy_(torch.where(opens, lo, torch.minimum(self.open_min, lo)))
        self.open_max.copy_(torch.where(opens, hi, torch.maximum(self.open_max, hi)))
        encoded = self.encode(self.open_min[:, :, None], self.open_max[:, :, None], self.dtype)
        encoded["empty"] = (torch.isinf(self.open_min).all(-1) & torch.isinf(self.open_max).all(-1))[:, :, None]
        for name, value in encoded.items():
            buffer = self.pages.buffers[name]
            if self.shift is None:
                buffer.index_copy_(2, page.view(1), value)
            else:  # each (sequence, group) its own page
                index = page.view(*page.shape, 1, *([1] * (value.dim() - 3))).expand_as(value)
                buffer.scatter_(2, index, value)
        self.count.add_(1)
        self.rows += 1
        extra = 0 if self.shift is None else size - 1  # a page more at most, unused ones empty
        self.pages.length.copy_(torch.div(self.count + (size - 1 + extra), size, rounding_mode="floor"))

    def _add_shifted(self, lo: torch.Tensor, hi: torch.Tensor, valid: torch.Tensor) -> None:
        """Rows ``lo``/``hi [B, G, k, D]`` (padding at ``+inf``/``-inf``) join a summary with shifts: each row's page
        ``(rows + i + shift) // page_size`` per (sequence, group), reduced into a window of page slots from
        ``rows // page_size``; the window's pages from each one's first touched page rewritten, the open page's earlier
        rows joined."""
        B, G, k, D = lo.shape
        size, R = self.page_size, self.rows
        pages = self.pages
        if pages.n != self.live_pages:  # after single rows (_add_one leaves the host's page count)
            pages.n = self.live_pages
            pages.length.fill_(pages.n)
        self._shift_for(valid)
        first = self.page_of(torch.full((B, G), R, dtype=torch.long, device=lo.device))  # [B, G]: the first touched
        w0 = R // size
        nw = (R + k - 1 + size - 1) // size - w0 + 1  # page slots the window spans (the largest shift included)
        page = self.page_of(R + torch.arange(k, device=lo.device).expand(B, G, k)) - w0  # [B, G, k], in the window
        index = page[..., None].expand(B, G, k, D)
        lo_w = lo.new_full((B, G, nw, D), float("inf")).scatter_reduce_(2, index, lo, "amin")
        hi_w = hi.new_full((B, G, nw, D), float("-inf")).scatter_reduce_(2, index, hi, "amax")
        at = (first - w0)[..., None, None].expand(B, G, 1, D)
        joins = ((R + self.shift) % size != 0)[..., None, None]  # the open page holds earlier rows
        lo_w.scatter_(2, at, torch.where(joins, torch.minimum(lo_w.gather(2, at), self.open_min[:, :, None]),
                                         lo_w.gather(2, at)))
        hi_w.scatter_(2, at, torch.where(joins, torch.maximum(hi_w.gather(2, at), self.open_max[:, :, None]),
                                         hi_w.gather(2, at)))
        encoded = self.encode(lo_w, hi_w, self.dtype)
        encoded["empty"] = torch.isinf(lo_w).all(-1) & torch.isinf(hi_w).all(-1)
        if pages.n < w0 + nw:  # room for the window's page slots (rewritten below)
            grow = w0 + nw - pages.n
            pages.append({name: value[:, :, nw - grow:] for name, value in encoded.items()})
        ahead = (torch.arange(nw, device=lo.device) >= (first - w0)[..., None])  # [B, G, nw]: pages this add writes
        for name, value in encoded.items():
            buffer = pages.buffers[name]
            old = buffer[:, :, w0 : w0 + nw]
            keep = ahead.view(B, G, nw, *([1] * (value.dim() - 3)))
            buffer[:, :, w0 : w0 + nw] = torch.where(keep, value, old)
        last = (self.page_of(torch.full((B, G), R + k - 1, dtype=torch.long, device=lo.device)) - w0)
        at = last[..., None, None].expand(B, G, 1, D)
        self.open_min.copy_(lo_w.gather(2, at)[:, :, 0])
        self.open_max.copy_(hi_w.gather(2, at)[:, :, 0])
        self.rows += k
        self.count.fill_(self.rows)
        pages.n = max(pages.n, w0 + nw)
        pages.length.fill_(pages.n)

    def select_batch(self, index: torch.Tensor) -> None:
        if self.pages.buffers:
            self.pages.select_batch(index)
            self.open_min = self.open_min.index_select(0, index)
            self.open_max = self.open_max.index_select(0, index)
            if self.shift is not None:
                self.shift = self.shift.index_select(0, index)
                self.started = self.started.index_select(0, index)

    def repeat_batch(self, repeats: int) -> None:
        if self.pages.buffers:
            self.pages.repeat_batch(repeats)
            self.open_min = self.open_min.repeat_interleave(repeats, dim=0)
            self.open_max = self.open_max.repeat_interleave(repeats, dim=0)
            if self.shift is not None:
                self.shift = self.shift.repeat_interleave(repeats, dim=0)
                self.started = self.started.repeat_interleave(repeats, dim=0)


def _quest_entries(lo: torch.Tensor, hi: torch.Tensor, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {"entries": quest_page_entries(lo, hi, dtype)[0]}  # the page summary's encoding for Quest


@functools.cache
def segment_heads(heads: int, groups: int, positions: int, device: torch.device) -> torch.Tensor:
    """``[1, H, K]`` bool: query head ``h`` reads segment ``h mod (H / G)`` of its group's ``K`` rows (a per-head
    choice's layout), the same tensor for every step of that shape."""
    per_group = heads // groups
    segment = torch.arange(positions, device=device) // (positions // per_group)
    return (segment[None] == (torch.arange(heads, device=device) % per_group)[:, None])[None]


class PageIndex(RetrievalState):
    """One index row per page of ``page_size`` archived rows, ``[max, min, max|k|]`` (``kernels/index_scan.py``), in
    a :class:`PageSummary`. The last page may be partial: its row is rewritten as rows join it. A page of padding
    rows only keeps ``max = -inf``, ``min = +inf`` and is flagged empty (never fetched).
    """

    needs_best = False

    def __init__(self, config: QuestRetriever, capacity: int | None = None) -> None:
        self.config = config
        self.page_size = config.page_size
        self.summary = PageSummary(config.page_size, _quest_entries, capacity)

    @property
    def pages(self) -> RowStore:
        """The encoded pages: ``entries``, ``empty``."""
        return self.summary.pages

    @property
    def entry_bytes(self) -> int:
        entries = self.summary.pages.buffers.get("entries")
        return 0 if entries is None else entries.shape[-1] * entries.element_size()  # 0: not defined yet

    @property
    def page_shift(self) -> torch.Tensor | None:
        """Virtual rows before each (sequence, group)'s archive, ``[B, G]`` (pages start at its first real row), or
        None (no padding: every page starts at a multiple of ``page_size``)."""
        return self.summary.shift

    def index(self, rows, tier, archive) -> None:
        keys = rows["keys"]
        D = keys.shape[-1]
        self.summary.add(keys, rows["valid"], {"entries": ((2 * D + 1,), keys.dtype)},
                         padded=archive is not None and archive.padded)

    def index_in_place(self, storage, positions) -> bool:
        """One row a step (``rule="eval"`` archives each decode step's row) joins the summary in one op,
        :func:`~kvzoo.kernels.choose.quest_page_add`, read where it lies and written at page ``count // page_size``:
        where the summary is defined and, fixed, not full. The host's counts follow: the rows, and a growing summary's
        page count (a fixed one's is brought up to date by the next multi-row add)."""
        summary, size = self.summary, self.page_size
        pages = summary.pages
        if positions.shape[2] != 1 or not pages.buffers or (pages.fixed and summary.rows >= pages.capacity * size):
            return False
        if summary.shift is not None:  # pages per sequence (padding): the summary's own add (the op's are aligned
            return False  # at row 0)
        if not pages.fixed and summary.rows % size == 0:  # the row opens a page: a slot for it (grown geometrically)
            pages.n = summary.live_pages
            pages.reserve(1)
        quest_page_add(storage["keys"], storage["valid"], positions[:, :, 0], summary.open_min, summary.open_max,
                       pages.buffers["entries"], pages.buffers["empty"], summary.count, pages.length, size)
        summary.rows += 1
        if not pages.fixed:
            pages.n = summary.live_pages
        return True

    def scan_cost(self, query_rows: int) -> tuple[int, int]:
        """Every page once: the live pages, or every page slot of a fixed index."""
        pages = self.summary.pages
        n = pages.capacity if pages.fixed else pages.n
        return n, n * self.entry_bytes

    def bounds(self, query: torch.Tensor, scaling: float) -> torch.Tensor:
        B, H, q_len, _ = query.shape
        pages = self.summary.pages
        entries = pages.reading("entries")  # a fixed index: every page, the unused ones empty
        bounds = index_scan(page_query(query, entries.shape[1]), entries, scaling)  # [B, G, hpg * q, p]
        bounds = bounds.masked_fill(pages.reading("empty")[:, :, None], float("-inf"))  # empty: never
        return bounds.view(B, H, q_len, -1)

    def choose(self, query, best, scaling, archive) -> Choice:
        B, H, q_len, D = query.shape
        G, size = archive.groups, self.page_size
        summary, pages = self.summary, self.summary.pages
        # rule="eval", a decode step: the step's own row (when the policy archives it next) and the open page's
        # running min/max, so that the current page is scored with the step's key in it, as the reference evaluation
        # code scores it (its new key joins the key states before any page is scored); rule="kernel" attends the
        # current page apart
        own = None
        if q_len == 1 and self.config.rule == "eval" and pages.buffers:
            row = archive.own_row
            own = None if row is None else (*row, summary.open_min, summary.open_max)
        # pages one head reads, at most the index's page slots (one more when the step's row may open a page)
        n = min((pages.capacity if pages.fixed else pages.n) + (own is not None),
                self.config.archived_pages(archive.budget))
        if n == 0:  # the kernel rule with B < 2 pages: the current page only, no archived page read
            none = torch.zeros(B, G, 1, dtype=torch.long, device=query.device)
            return Choice(none, torch.zeros_like(none, dtype=torch.bool))
        per_head = self.config.gqa == "head"
        if q_len == 1:  # a decode step: one op (kernels/choose.py) from the query to the rows and their count
            counter = archive.fetched
            rows, positions, ok, count = quest_choose(
                query.float().reshape(B, G, H // G, D), pages.reading("entries"), pages.reading("empty"),
                summary.count, archive.positions, n, size, archive.rows, scaling, per_head=per_head,
                counter=counter, own=own, shift=summary.shift)
            # per head: each head reads its own segment (no union to stage), the group's union counted once
            head_valid = segment_heads(H, G, rows.shape[2], query.device).expand(B, -1, -1) if per_head else None
            return Choice(rows, ok, head_valid=head_valid, positions=positions, count=count,
                          counted=counter is not None)
        bounds = self.bounds(query, scaling)  # [B, H, q, p]
        if per_head:  # each head's own pages
            top = bounds.topk(n, dim=-1).indices  # [B, H, q, n]
        else:  # one page set per KV group: the max over its heads
            top = bounds.view(B, G, H // G, q_len, -1).amax(dim=2).topk(n, dim=-1).indices  # [B, G, q, n]
        rows = (top[..., None] * size + torch.arange(size, device=top.device)).view(B, G, -1)
        if summary.shift is not None:  # pages from each sequence's first real row
            rows = rows - summary.shift[..., None]
            return Choice(rows.clamp(min=0), (rows >= 0) & (rows < summary.rows))
        return Choice(rows, rows < summary.rows)  # a multi-token choice: only its mask is read

    def select_batch(self, index: torch.Tensor) -> None:
        self.summary.select_batch(index)

    def repeat_batch(self, repeats: int) -> None:
        self.summary.repeat_batch(repeats)
