"""VestigeKV's certified low-rank sketch (paper §4.2, Lemma 2): the default index on MLA rows.

Per archived row u: ``(z_u = V^T c_u, eta_u = ||(I - V V^T) c_u||, r_u, ||c_u||, ||r_u||)``, V an orthonormal basis
of the content latents fitted per sequence and layer from the first closed block (``refit=True``: at every block);
``bound = scale (<q_r, r_u> + <V^T q_c', z_u> + ||(I - V V^T) q_c'|| eta_u) >= s(u)`` plus a float slack, and the
*estimate* is the bound less its Cauchy-Schwarz term and slack. On GQA rows the whole key is the content.
"""

from __future__ import annotations

import torch

from kvzoo.framework.retriever import Choice, RowGeometry
from kvzoo.kernels.choose import sketch_choose
from kvzoo.kernels.index_scan import (
    SKETCH_SLACK,
    SKETCH_SLACK_FP16,
    index_scan,
    index_scan_reduce,
    round_entries_fp16,
    sketch_entries,
    sketch_query,
)
from kvzoo.retrievers.int8 import EntryIndex


class SketchIndex(EntryIndex):
    """One entry per archived row, ``[z, eta, r, ||c||, ||r||]`` (``kernels/index_scan.py``: fp32, or fp16 with a
    widened slack), in archive order; one basis per sequence (module docstring)."""

    def __init__(self, config, geometry: RowGeometry) -> None:
        super().__init__(config, geometry)
        self.basis: torch.Tensor | None = None  # [B, G, dc, rank], orthonormal columns

    @property
    def _rank(self) -> int:
        return self.basis.shape[-1]

    @property
    def _slack(self) -> float:
        return SKETCH_SLACK_FP16 if self.config.entry_dtype == "float16" else SKETCH_SLACK

    def _split(self, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.geometry.layout == "mla":
            dc = self.geometry.content_dim
            return keys[..., :dc], keys[..., dc:]
        return keys, None

    def _fit(self, block_keys: torch.Tensor, valid: torch.Tensor) -> None:
        content, _ = self._split(block_keys)
        dc = content.shape[-1]
        rank = self.config.rank or (64 if self.geometry.layout == "mla" else max(1, dc // 4))
        rank = min(rank, dc)
        x = content.double() * valid[..., None].double()  # padding rows do not shape the basis
        gram = x.transpose(-1, -2) @ x  # [B, G, dc, dc], one per sequence
        _, vectors = torch.linalg.eigh(gram)  # ascending eigenvalues
        self.basis = vectors[..., -rank:].flip(-1).float().contiguous()

    def _entries(self, keys: torch.Tensor) -> dict[str, torch.Tensor]:
        content, branch = self._split(keys)
        entries = sketch_entries(content, branch, self.basis)
        if self.config.entry_dtype == "float16":
            entries = round_entries_fp16(entries, self._rank, 0 if branch is None else branch.shape[-1])
        return {"entries": entries}

    def index(self, rows, tier, archive) -> None:
        if self.basis is None or self.config.refit:
            self._fit(tier.keys, tier.valid)  # the closing block: the tier before the rows leave
            if self.config.refit and self.rows.n:  # rebuild the index of earlier rows under the new basis
                self.rows = type(self.rows)()
                self._append(self._entries(archive.keys), archive.valid)
        self._append(self._entries(rows["keys"]), rows["valid"])

    def _query_rows(self, query: torch.Tensor) -> torch.Tensor:
        """The sketch's query rows ``[B, G, hpg * q, W]`` (a group's heads, then queries)."""
        if self.geometry.layout == "mla":
            dc = self.geometry.content_dim
            return sketch_query(query[..., :dc], query[..., dc:], self.basis, slack=self._slack)
        return sketch_query(query, None, self.basis, slack=self._slack)

    def bounds(self, query: torch.Tensor, scaling: float) -> torch.Tensor:
        B, H, q_len, _ = query.shape
        scan = index_scan(self._query_rows(query), self.rows.reading("entries"), scaling, length=self._length(B))
        return scan.view(B, H, q_len, -1)

    def bounds_and_estimates(self, query: torch.Tensor, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
        """The bounds ``[B, H, q, m]`` and their estimates ``scale (<q_r, r> + <V^T q_c, z>)`` -- each bound less its
        Cauchy-Schwarz term ``scale ||(I - V V^T) q_c|| eta`` and its slack -- in one scan (the columns read are
        the same entries)."""
        B, H, q_len, _ = query.shape
        qrows = self._query_rows(query)  # [B, G, hq, W]
        W, hq = qrows.shape[-1], qrows.shape[2]
        slack_cols = 2 if self.geometry.layout == "mla" else 1  # eps ||q_c|| ||c|| (+ eps ||q_r|| ||r||)
        in_span = qrows.clone()  # the estimate's query rows: eta's column and the slack's zeroed
        in_span[..., self._rank] = 0
        in_span[..., W - slack_cols :] = 0
        both = index_scan(torch.cat([qrows, in_span], dim=2), self.rows.reading("entries"), scaling,
                          length=self._length(B))  # one scan
        return both[:, :, :hq].reshape(B, H, q_len, -1), both[:, :, hq:].reshape(B, H, q_len, -1)

    def choose(self, query, best, scaling, archive) -> Choice:
        """A decode step's top-j rule (one query per sequence) is one op, :func:`~kvzoo.kernels.choose.sketch_choose`:
        the query rows, the scan, each query row's top ``j``, their bounds, the group's union staged and counted (one
        C call on CPU; its PyTorch reference, today's ops, elsewhere). Every other case: the shared rule."""
        config = self.config
        if config.certified or query.shape[2] != 1:
            return super().choose(query, best, scaling, archive)
        B, H, _, D = query.shape
        entries = self.rows.reading("entries")  # a fixed index: the whole buffer, scanned with its length
        G, m = entries.shape[1], entries.shape[2]
        floor = (best - config.j_margin).reshape(B, G, H // G)  # [B, G, hq]: s* - j_margin
        counter = archive.fetched
        idx, picked, count = sketch_choose(query.float().reshape(B, G, H // G, D), self.basis, entries, floor,
                                           min(config.j, m), archive.rows or m, scaling, slack=self._slack,
                                           rank_by=config.rank_by, length=self._length(B), counter=counter,
                                           valid=self._valid(archive))
        return Choice(idx, picked, count=count, counted=counter is not None)

    def within(self, query: torch.Tensor, threshold: torch.Tensor, scaling: float) -> torch.Tensor:
        """One fused scan reduced over the group's heads and queries (the ``[B, H, q, m]`` bounds never exist):
        ``margin >= 0`` exactly where some bound ``>= threshold`` (``kernels/index_scan.py``)."""
        B, G = threshold.shape[0], self.basis.shape[1]
        margin = index_scan_reduce(self._query_rows(query), self.rows.reading("entries"), scaling,
                                   threshold.reshape(B, G, -1), length=self._length(B))
        return margin >= 0

    def select_batch(self, index: torch.Tensor) -> None:
        super().select_batch(index)
        if self.basis is not None:
            self.basis = self.basis.index_select(0, index)

    def repeat_batch(self, repeats: int) -> None:
        super().repeat_batch(repeats)
        if self.basis is not None:
            self.basis = self.basis.repeat_interleave(repeats, dim=0)
