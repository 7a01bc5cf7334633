"""VestigeKV's int8 key index: the default on GQA rows (no branch there, and a per-row code beats a low-rank sketch).

Per archived row: the key's int8 codes, an fp16 scale, an error norm and a norm (``D + 6`` bytes,
:func:`~kvzoo.kernels.index_scan.int8_key_entries`); bound ``s <q, codes> + ||q|| err + slack >= <q, k>`` and
estimate ``s <q, codes>`` (the score of the row's int8 reconstruction). A decode step's top-j rule -- the scan,
each query row's top j, the chosen rows' bounds, the group's union and its count -- is one call
(:func:`~kvzoo.kernels.index_scan.int8_choose`: one C loop on CPU tensors, PyTorch elsewhere).
"""

from __future__ import annotations

import torch

from kvzoo.framework.retriever import ArchiveView, Choice
from kvzoo.kernels.index_scan import (
    fused_choose_applies,
    int8_bound_from,
    int8_choose,
    int8_key_bounds,
    int8_key_entries,
    int8_key_estimate,
)
from kvzoo.retrievers.entries import EntryIndex


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
        codes, length = self._scanned(B, "codes")
        side, _ = self._scanned(B, "side")
        bound, estimate = int8_key_bounds(self._grouped(query), codes, side, scaling, length=length)
        return bound.view(B, H, q_len, -1), estimate.view(B, H, q_len, -1)

    def bounds(self, query: torch.Tensor, scaling: float) -> torch.Tensor:
        return self.bounds_and_estimates(query, scaling)[0]

    def top_j(self, query: torch.Tensor, floor: torch.Tensor, scaling: float, archive: ArchiveView) -> Choice:
        """Top-j by estimate over the int8 entries: one pass over the codes, then the certified bound of the ``j``
        chosen rows per query row only (the same numbers the whole ``[B, H, q, m]`` bounds would hold there), kept
        where it is above ``floor``. A decode step on CPU does all of it, and the group's union, in one call."""
        B, H, q_len, D = query.shape
        codes, length = self._scanned(B, "codes")
        side, _ = self._scanned(B, "side")
        G = codes.shape[1]
        hq = (H // G) * q_len
        q = self._grouped(query)
        j = min(self.config.j, codes.shape[2])
        counter = archive.fetched if archive is not None else None
        if q_len == 1 and fused_choose_applies(q, codes, side, j, counter):  # a decode step: one call does it all
            archived = archive.rows if archive is not None and archive.rows else codes.shape[2]
            idx, picked, count = int8_choose(q, codes, side, floor.reshape(B, G, hq), j, archived, scaling,
                                             length=length, counter=counter)
            return Choice(staged=(idx, picked), count=count, counted=counter is not None)
        estimate = int8_key_estimate(q, codes, side, scaling, length=length)  # [B, G, hq, m]
        top, rows = estimate.topk(j, dim=-1)  # [B, G, hq, j]
        w = side.shape[-1]
        picked_side = side[:, :, None].expand(B, G, hq, side.shape[2], w).gather(
            3, rows[..., None].expand(B, G, hq, j, w))  # [B, G, hq, j, 3]
        ok = int8_bound_from(top, q, picked_side, scaling) > floor.reshape(B, G, hq, 1)
        return Choice(rows=rows.view(B, G, -1), ok=ok.view(B, G, -1))
