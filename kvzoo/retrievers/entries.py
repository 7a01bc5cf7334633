"""What VestigeKV's index kinds share: one entry per archived row (in archive order) and the selection rule.

An :class:`EntryIndex` keeps its entries in a :class:`~kvzoo.framework.buffers.RowStore` (named buffers
``[B, G, m, ...]``, preallocated for every row with ``TieredCache(..., capacity=N)`` and then scanned whole with
the live count on the device), and chooses rows by the retriever's rule (:class:`~kvzoo.retrievers.vestige.
VestigeRetriever`): top-``j`` per query head ranked by the bound's estimate (or by the bound), each kept where
its bound is above ``s* - j_margin``; or, certified, every row whose bound is ``>= s* - tau``. An index kind says
how it scans (:meth:`EntryIndex.bounds`, :meth:`EntryIndex.bounds_and_estimates`, :meth:`EntryIndex.within`) and
may do the top-j rule in one fused call (:meth:`EntryIndex.top_j`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvzoo.framework.buffers import RowStore
from kvzoo.framework.retriever import ArchiveView, Choice, RetrievalState, RowGeometry

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
    def entry_bytes(self) -> int:  # type: ignore[override]
        total = 0
        for b in self.rows.buffers.values():  # a loop, not a generator: read per layer per step
            total += b.shape[-1] * b.element_size()
        return total

    @property
    def groups(self) -> int:
        return next(iter(self.rows.buffers.values())).shape[1]

    def entries(self) -> int:
        return self.rows.n

    def _append(self, entries: dict[str, torch.Tensor]) -> None:
        if not self.rows.buffers:  # with a fixed capacity: preallocated for every row, scanned with its length
            first = next(iter(entries.values()))
            B, G = first.shape[:2]
            capacity = self.geometry.capacity
            self.rows.define(B, G, {k: ((v.shape[-1],), v.dtype) for k, v in entries.items()}, first.device,
                             capacity=capacity or 0, fixed=capacity is not None)
        self.rows.append(entries)

    def _scanned(self, batch: int, name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The entries a scan reads and their count per sequence (a fixed index: the whole buffer, its length)."""
        if self.rows.fixed:
            return self.rows.reading(name), self.rows.length.expand(batch)
        return self.rows.get(name), None

    # --- what an index kind provides ----------------------------------------------------------------
    def bounds_and_estimates(self, query: torch.Tensor, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
        """The bounds ``[B, H, q, m]`` and their estimates (the ranking score)."""
        raise NotImplementedError(f"{type(self).__name__} has no estimate")  # every shipped kind overrides it

    def within(self, query: torch.Tensor, threshold: torch.Tensor, scaling: float) -> torch.Tensor:
        """Bool ``[B, G, m]``: the rows whose bound is ``>= threshold [B, H, q]`` for some query row of the group."""
        bounds = self.bounds(query, scaling)  # [B, H, q, m]
        B, H, q_len, m = bounds.shape
        G = self.groups
        keep = bounds >= threshold[..., None]
        return keep.view(B, G, (H // G) * q_len, m).any(2)

    def top_j(self, query: torch.Tensor, floor: torch.Tensor, scaling: float, archive: ArchiveView) -> Choice:
        """Each query row's top ``j`` rows by estimate, kept where their bound is above ``floor [B, H, q, 1]``."""
        bounds, estimates = self.bounds_and_estimates(query, scaling)
        rows = estimates.topk(min(self.config.j, bounds.shape[-1]), dim=-1).indices  # [B, H, q, j]
        ok = bounds.gather(-1, rows) > floor
        B = query.shape[0]
        return Choice(rows=rows.view(B, self.groups, -1), ok=ok.view(B, self.groups, -1))

    # --- the rule ----------------------------------------------------------------------------------------
    def choose(self, query, best, scaling, archive) -> Choice:
        config = self.config
        if config.certified:  # every row within tau of s*, for some head and query of the group
            return Choice(mask=self.within(query, best - config.tau, scaling))
        floor = best[..., None] - config.j_margin  # [B, H, q, 1]
        if config.rank_by == "estimate":  # each head's top j rows by estimate, kept where bound > s* - margin
            return self.top_j(query, floor, scaling, archive)
        bounds = self.bounds(query, scaling)  # each head's top j rows by bound, kept where bound > s* - margin
        top, rows = bounds.topk(min(config.j, bounds.shape[-1]), dim=-1)  # [B, H, q, j]
        B = query.shape[0]
        return Choice(rows=rows.view(B, self.groups, -1), ok=(top > floor).view(B, self.groups, -1))

    def select_batch(self, index: torch.Tensor) -> None:
        self.rows.select_batch(index)

    def repeat_batch(self, repeats: int) -> None:
        self.rows.repeat_batch(repeats)
