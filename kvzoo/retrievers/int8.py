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
from kvzoo.kernels.index_scan import int8_choose, int8_key_bounds, int8_key_entries, unique_candidates

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
        for b in self.rows.buffers.values():  # a loop, not a generator: read per layer per step
            total += b.shape[-1] * b.element_size()
        return total

    @property
    def groups(self) -> int:
        return next(iter(self.rows.buffers.values())).shape[1]

    def scan_cost(self, query_rows: int) -> tuple[int, int]:
        """Every entry once."""
        return self.rows.n, self.rows.n * self.entry_bytes

    def _append(self, entries: dict[str, torch.Tensor]) -> None:
        if not self.rows.buffers:  # with a fixed capacity: preallocated for every row, scanned with its length
            first = next(iter(entries.values()))
            B, G = first.shape[:2]
            capacity = self.geometry.capacity
            self.rows.define(B, G, {k: ((v.shape[-1],), v.dtype) for k, v in entries.items()}, first.device,
                             capacity=capacity or 0, fixed=capacity is not None)
        self.rows.append(entries)

    def _length(self, batch: int) -> torch.Tensor | None:
        """The live entries per sequence, ``[batch]``, when a scan reads a fixed index's whole buffers (else None)."""
        return self.rows.length.expand(batch) if self.rows.fixed else None

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
        if config.certified:  # every row within tau of s*, for some head and query of the group
            return Choice(None, self.within(query, best - config.tau, scaling))
        # each head's top j rows by estimate (or by bound), kept where their bound > s* - j_margin
        if config.rank_by == "estimate":
            bounds, ranking = self.bounds_and_estimates(query, scaling)
        else:
            bounds = ranking = self.bounds(query, scaling)
        m = bounds.shape[-1]
        rows = ranking.topk(min(config.j, m), dim=-1).indices  # [B, H, q, j]
        ok = bounds.gather(-1, rows) > best[..., None] - config.j_margin
        B, G = query.shape[0], self.groups
        return Choice(*unique_candidates(rows.view(B, G, -1), ok.view(B, G, -1), archive.rows or m))

    def select_batch(self, index: torch.Tensor) -> None:
        self.rows.select_batch(index)

    def repeat_batch(self, repeats: int) -> None:
        self.rows.repeat_batch(repeats)


class Int8KeyIndex(EntryIndex):
    """One entry per archived row: ``codes [D]`` int8 and ``side [scale, err, norm]`` fp16, in archive order."""

    def index(self, rows, tier, archive) -> None:
        codes, side = int8_key_entries(rows["keys"])  # no basis: each row's own code, scale and error
        self._append({"codes": codes, "side": side})

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
        each head's top ``j``, their bounds against ``s* - j_margin``, the group's union staged and counted). Every
        other case: the shared rule."""
        config = self.config
        if config.certified or config.rank_by != "estimate" or query.shape[2] != 1:
            return super().choose(query, best, scaling, archive)
        B, H, _, D = query.shape
        rows = self.rows
        codes = rows.reading("codes")  # a fixed index: the whole buffer, scanned with its length
        G, m = codes.shape[1], codes.shape[2]
        counter = archive.fetched
        idx, picked, count = int8_choose(query.float().reshape(B, G, H // G, D), codes, rows.reading("side"),
                                         (best - config.j_margin).reshape(B, G, H // G), min(config.j, m),
                                         archive.rows or m, scaling,
                                         length=rows.length.expand(B) if rows.fixed else None, counter=counter)
        return Choice(idx, picked, count=count, counted=counter is not None)
