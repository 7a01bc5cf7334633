"""VestigeKV's per-row index entries (:class:`EntryIndex`, what its index kinds share) and the int8 key index.

An :class:`EntryIndex` keeps one entry per archived row, in archive order, in a
:class:`~kvzoo.framework.buffers.RowStore` (preallocated with ``TieredCache(..., capacity=N)`` and scanned whole with
the live count), and chooses rows by :class:`~kvzoo.retrievers.vestige.VestigeRetriever`'s rule; a kind says how it
scans (:meth:`EntryIndex.bounds_and_estimates`) and may fuse a decode step's rule into one op (:meth:`EntryIndex.choose`).
:class:`Int8KeyIndex` (GQA's default: no branch there, and a per-row code beats a low-rank sketch) holds each row's
int8 key codes, scale, error norm and norm (``D + 6`` bytes): bound ``s <q, codes> + ||q|| err + slack >= <q, k>``,
estimate ``s <q, codes>``.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import TYPE_CHECKING

import torch

from kvzoo.framework.buffers import RowStore
from kvzoo.framework.retriever import ArchiveView, Choice, RetrievalState, RowGeometry
from kvzoo.kernels.index_scan import (
    int8_choose,
    int8_key_bounds,
    int8_key_entries,
    int8_page_bounds,
    int8_page_entries,
    int8_page_live,
    page_rows_live,
    unique_candidates,
)
from kvzoo.retrievers.quest import PageSummary

if TYPE_CHECKING:
    from kvzoo.framework.retriever import Retriever


class EntryIndex(RetrievalState):
    """Per-row entries over a layer's archive and VestigeKV's selection rule (module docstring)."""

    def __init__(self, config: Retriever, geometry: RowGeometry) -> None:  # a VestigeRetriever (its j, tau, ...)
        self.config = config
        self.geometry = geometry
        self.rows = RowStore()  # the entries, [B, G, m, ...] per buffer, in archive order
        self.audit_top = config.j

    @property
    def entry_bytes(self) -> int:
        total = 0
        for name, b in self.rows.buffers.items():  # a loop, not a generator: read per layer per step
            if name != "valid":  # the row's flag (read only when some row is padding)
                total += b.shape[-1] * b.element_size()
        return total

    @property
    def groups(self) -> int:
        return next(iter(self.rows.buffers.values())).shape[1]

    def scan_cost(self, query_rows: int) -> tuple[int, int]:
        """Every entry once."""
        return self.rows.n, self.rows.n * self.entry_bytes

    def _append(self, entries: dict[str, torch.Tensor], valid: torch.Tensor) -> None:
        """Entries ``[B, G, k, ...]`` of rows joining the archive, and the rows' ``valid [B, G, k]`` (False: padding,
        kept beside the entries so that a scan of a padded batch leaves those rows out)."""
        if not self.rows.buffers:  # with a fixed capacity: preallocated for every row, scanned with its length
            first = next(iter(entries.values()))
            B, G = first.shape[:2]
            capacity = self.geometry.capacity
            fields = {k: ((v.shape[-1],), v.dtype) for k, v in entries.items()}
            self.rows.define(B, G, {**fields, "valid": ((), torch.bool)}, first.device, capacity=capacity or 0,
                             fixed=capacity is not None)
        self.rows.append({**entries, "valid": valid})

    def _length(self, batch: int) -> torch.Tensor | None:
        """The live entries per sequence, ``[batch]``, when a scan reads a fixed index's whole buffers (else None)."""
        return self.rows.length.expand(batch) if self.rows.fixed else None

    def _valid(self, archive: ArchiveView) -> torch.Tensor | None:
        """The entries' rows' validity ``[B, G, m]`` as the scans read the entries (a fixed index: the whole buffer,
        False past the live rows), or None when no archived row is padding (``archive.padded``: the common path
        reads no flag). A padding row never takes a top-j slot, whatever its entry scores."""
        return self.rows.reading("valid") if archive.padded else None

    @staticmethod
    def _leave_out(scores: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
        """``scores [B, H, q, m]`` with the padding rows' (``valid [B, G, m]`` False) set to ``-inf``."""
        if valid is None:
            return scores
        B, H, q_len, m = scores.shape
        G = valid.shape[1]
        out = scores.view(B, G, (H // G) * q_len, m).masked_fill(~valid[:, :, None, :m], float("-inf"))
        return out.view(B, H, q_len, m)

    @abstractmethod
    def bounds_and_estimates(self, query: torch.Tensor, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Every entry's bound ``[B, H, q, m]`` and its estimate (the ranking score)."""

    def bounds(self, query: torch.Tensor, scaling: float) -> torch.Tensor:
        return self.bounds_and_estimates(query, scaling)[0]

    def within(self, query: torch.Tensor, threshold: torch.Tensor, scaling: float) -> torch.Tensor:
        """Bool ``[B, G, m]``: the rows whose bound is ``>= threshold [B, H, q]`` for some query row of the group."""
        bounds = self.bounds_and_estimates(query, scaling)[0]  # [B, H, q, m]: every row's own bound
        B, H, q_len, m = bounds.shape
        G = self.groups
        return (bounds >= threshold[..., None]).view(B, G, (H // G) * q_len, m).any(2)

    def choose(self, query: torch.Tensor, best: torch.Tensor, scaling: float, archive: ArchiveView) -> Choice:
        config = self.config
        valid = self._valid(archive)
        if config.certified:  # every row within tau of s*, for some head and query of the group
            chosen = self.within(query, best - config.tau, scaling)
            return Choice(None, chosen if valid is None else chosen & valid[..., : chosen.shape[-1]])
        # each head's top j rows by estimate (or by bound), kept where their bound > s* - j_margin
        if config.rank_by == "estimate":
            bounds, ranking = self.bounds_and_estimates(query, scaling)
            bounds, ranking = self._leave_out(bounds, valid), self._leave_out(ranking, valid)
        else:
            bounds = ranking = self._leave_out(self.bounds(query, scaling), valid)
        m = bounds.shape[-1]
        rows = ranking.topk(min(config.j, m), dim=-1).indices  # [B, H, q, j]
        ok = bounds.gather(-1, rows) > best[..., None] - config.j_margin
        B, G = query.shape[0], self.groups
        return Choice(*unique_candidates(rows.view(B, G, -1), ok.view(B, G, -1), archive.rows or m))

    def select_batch(self, index: torch.Tensor) -> None:
        self.rows.select_batch(index)

    def repeat_batch(self, repeats: int) -> None:
        self.rows.repeat_batch(repeats)


def int8_pages(lo: torch.Tensor, hi: torch.Tensor, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A page summary's encoding (:class:`~kvzoo.retrievers.quest.PageSummary`): key min/max as int8 codes and one
    scale, ``2 D + 4`` bytes a page (:func:`~kvzoo.kernels.index_scan.int8_page_entries`)."""
    codes, scale = int8_page_entries(lo, hi)
    return {"codes": codes, "scale": scale}


class Int8KeyIndex(EntryIndex):
    """One entry per archived row: ``codes [D]`` int8 and ``side [scale, err, norm]`` fp16, in archive order.

    ``prune=True`` (:class:`~kvzoo.retrievers.vestige.VestigeRetriever`): also a page summary, per ``page_rows``
    archived rows (in archive order) the min and max of their exact keys as int8 codes (Quest's page, ``2 D + 5``
    bytes with its empty flag; the open last page rewritten as rows join it). A decode step's top-j rule first scans
    the pages: one whose certified bound is ``<= s* - j_margin`` for every head of its group holds no row scoring above
    ``s* - j_margin`` (the rule's floor), and its rows' int8 entries are not read
    (:func:`~kvzoo.kernels.index_scan.int8_page_live`, then :func:`~kvzoo.kernels.index_scan.int8_choose` with the
    page flags); the step's choice then reports the bytes it read, counted on the device."""

    def __init__(self, config, geometry) -> None:
        super().__init__(config, geometry)
        self.summary = PageSummary(config.page_rows, int8_pages, geometry.capacity) if self._summarised() else None
        self.page_live: torch.Tensor | None = None  # the latest pruned decode step's page flags [B, G, p] (audits)

    def _summarised(self) -> bool:
        """Whether this index keeps the page summary (pruning)."""
        return self.config.prune

    @property
    def page_shift(self) -> torch.Tensor | None:
        """The page summary's shifts ``[B, G]`` (pages start at each sequence's first real row), or None."""
        return None if self.summary is None else self.summary.shift

    @property
    def pages(self):
        """The page summary's encoded pages (``codes``, ``scale``, ``empty``)."""
        return self.summary.pages

    @property
    def page_bytes(self) -> int:
        """Bytes of one page summary: its codes, scale and empty flag."""
        return sum(b.shape[-1] * b.element_size() if b.dim() > 3 else b.element_size()
                   for b in self.pages.buffers.values())

    def index(self, rows, tier, archive) -> None:
        codes, side = int8_key_entries(rows["keys"])  # no basis: each row's own code, scale and error
        self._append({"codes": codes, "side": side}, rows["valid"])
        if self.summary is not None:
            D = rows["keys"].shape[-1]
            self.summary.add(rows["keys"], rows["valid"],
                             {"codes": ((2 * D,), torch.int8), "scale": ((), torch.float32)},
                             padded=archive is not None and archive.padded)

    def _grouped(self, query: torch.Tensor) -> torch.Tensor:
        B, H, q_len, D = query.shape
        G = self.groups
        return query.float().reshape(B, G, (H // G) * q_len, D)

    def bounds_and_estimates(self, query: torch.Tensor, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
        B, H, q_len, _ = query.shape
        bound, estimate = int8_key_bounds(self._grouped(query), self.rows.reading("codes"), self.rows.reading("side"),
                                          scaling, length=self._length(B))
        return bound.view(B, H, q_len, -1), estimate.view(B, H, q_len, -1)

    def choose(self, query, best, scaling, archive) -> Choice:
        """A decode step's top-j rule by estimate is one op, :func:`~kvzoo.kernels.index_scan.int8_choose` (the scan,
        each head's top ``j``, their bounds against ``s* - j_margin``, the group's union staged and counted); with
        pruning the page summary is scanned first and only the live pages' entries are read (class docstring). Every
        other case: the shared rule over every entry."""
        config = self.config
        if config.certified or config.rank_by != "estimate" or query.shape[2] != 1:
            return super().choose(query, best, scaling, archive)
        B, H, _, D = query.shape
        rows = self.rows
        codes = rows.reading("codes")  # a fixed index: the whole buffer, scanned with its length
        G, m = codes.shape[1], codes.shape[2]
        q = query.float().reshape(B, G, H // G, D)
        floor = (best - config.j_margin).reshape(B, G, H // G)
        counter = archive.fetched
        page_live = scanned = None
        if self.summary is not None and self.pages.buffers:
            pages = self.pages
            page_live = int8_page_live(q, pages.reading("codes"), pages.reading("scale"), pages.reading("empty"), floor,
                                       scaling, length=pages.length.expand(B) if pages.fixed else None)
            # what the step reads, on the device: every page summary scanned (a fixed index: every slot), then the
            # live pages' entries (the op adds them)
            scanned = torch.full((), B * G * self.summary.entries() * self.page_bytes, dtype=torch.long,
                                 device=q.device)
        self.page_live = page_live  # this step's (the audit reads them)
        idx, picked, count = int8_choose(q, codes, rows.reading("side"), floor, min(config.j, m), archive.rows or m,
                                         scaling, length=rows.length.expand(B) if rows.fixed else None,
                                         counter=counter, page_live=page_live,
                                         page_rows=config.page_rows if page_live is not None else 0, scanned=scanned,
                                         valid=self._valid(archive), page_shift=self.page_shift)
        return Choice(idx, picked, count=count, counted=counter is not None, index_bytes=scanned)

    def audit_step(self, query, best, scaling, exact, valid) -> dict[str, int]:
        """Pruning's certificate, checked on a decode step's exact scores: ``pruning_violations``, the (row, head)
        pairs of a skipped row scoring above ``s* - j_margin`` (must be 0) of ``pruning_audited`` (every valid row,
        every head); ``page_bound_violations``, the (page, head) pairs whose bound is below the page's best exact
        score (must be 0) of ``page_bounds_audited``; ``pages`` (holding a valid row), ``pages_skipped`` and
        ``pages_prunable`` (those whose best row scores ``<= s* - j_margin`` for every head: the most any certified
        page bound could skip); ``rows_skipped`` (valid rows per group) and ``rows_above_floor`` (valid rows per group
        scoring above the floor for some head: what no certified pruning may skip) of ``rows_audited``."""
        if self.page_live is None:
            return {}
        B, G, m = valid.shape
        hq = exact.shape[1] // G
        size = self.config.page_rows
        floor = (best - self.config.j_margin).reshape(B, G, hq, 1)
        scores = exact.reshape(B, G, hq, m).masked_fill(~valid[:, :, None], float("-inf"))
        page_live = self.page_live
        skipped = valid & ~page_rows_live(page_live, size, m, self.page_shift)  # [B, G, m]
        pages = page_live.shape[2]
        page = self.summary.page_of(torch.arange(m, device=scores.device).expand(B, G, m)).clamp(max=pages - 1)
        page_best = scores.new_full((B, G, hq, pages), float("-inf")).scatter_reduce_(
            3, page[:, :, None].expand(B, G, hq, m), scores, "amax")  # [B, G, hq, pages]
        held = (page_best > float("-inf")).any(2)  # pages holding a valid row
        summary = self.pages
        bounds = int8_page_bounds(self._grouped(query), summary.reading("codes"), summary.reading("scale"),
                                  scaling)[..., :pages]  # [B, G, hq, pages]
        return {"pruning_violations": int((skipped[:, :, None] & (scores > floor)).sum()),
                "pruning_audited": int(valid.sum()) * hq, "rows_skipped": int(skipped.sum()),
                "rows_above_floor": int((scores > floor).any(2).sum()), "rows_audited": int(valid.sum()),
                "page_bound_violations": int((held[:, :, None] & (bounds < page_best)).sum()),
                "page_bounds_audited": int(held.sum()) * hq, "pages": int(held.sum()),
                "pages_skipped": int((held & ~page_live[..., :pages]).sum()),
                "pages_prunable": int((held & (page_best <= floor).all(2)).sum())}

    def select_batch(self, index: torch.Tensor) -> None:
        super().select_batch(index)
        if self.summary is not None:
            self.summary.select_batch(index)

    def repeat_batch(self, repeats: int) -> None:
        super().repeat_batch(repeats)
        if self.summary is not None:
            self.summary.repeat_batch(repeats)
