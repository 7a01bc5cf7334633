"""A decode step's fused retrieval ops: each a PyTorch reference beside the C op that does its work in one call.

On a CPU decode step (one query per sequence) a retriever's choice was a chain of 20-60 small torch ops per layer:
build the query rows, scan the index, take each query row's top rows, check their bounds, stage the group's union,
count it. Each op here does that chain in one call of :mod:`kvzoo.kernels.cpu_native` (a registered torch op with a
Meta implementation, so a trace counts one launch and ``torch.compile`` takes it whole). Its ``*_reference`` is the
specification: the torch path kvzoo always ran, op for op, so that the two agree up to fp32 summation order
(``tests/test_native_choose.py`` holds each op to its reference). The public name picks one per call: the C op on
CPU tensors it takes (``cpu_native.*_supported``), the reference elsewhere -- a GPU (where the reference's scan is
the Triton kernel of :mod:`kvzoo.kernels.index_scan`), ``KVZOO_KERNELS=torch``, or no C compiler.

* :func:`sketch_choose` -- VestigeKV's top-j rule over its certified low-rank sketch (``retrievers/sketch.py``);
* :func:`unique_candidates` -- how the runtime stages a group's candidates (the form the choose ops return).

A choose op counts what it stages (``count``: int64, 0-dim, over the batch and groups) and, given ``counter`` (the
layer's ``fetched_rows``), adds the count to it in place, so the retrieval tier launches nothing more for it.
"""

from __future__ import annotations

import torch

from kvzoo.kernels import cpu_native
from kvzoo.kernels.dispatch import mode
from kvzoo.kernels.index_scan import SKETCH_SLACK, index_scan, sketch_query

RANK_BY = ("estimate", "bound")


def unique_candidates(rows: torch.Tensor, ok: torch.Tensor, archived: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Candidates ``[B, G, K]`` with each chosen row kept once: sorted indices and a picked flag (the form a
    fused choice returns itself). ``O(K log K)`` in the candidates, independent of the archive."""
    idx = torch.where(ok, rows, archived).sort(dim=-1).values
    picked = idx < archived
    picked[..., 1:] &= idx[..., 1:] != idx[..., :-1]
    return idx.clamp_(max=archived - 1), picked


def _counted(picked: torch.Tensor, counter: torch.Tensor | None) -> torch.Tensor:
    count = picked.sum()
    if counter is not None:
        counter.add_(count)
    return count


# --- VestigeKV's sketch --------------------------------------------------------------------------------------------


def sketch_choose_reference(query: torch.Tensor, basis: torch.Tensor, entries: torch.Tensor, floor: torch.Tensor,
                            j: int, archived: int, scaling: float, *, slack: float = SKETCH_SLACK,
                            rank_by: str = "estimate", length: torch.Tensor | None = None,
                            counter: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`sketch_choose` in PyTorch: the query rows (:func:`~kvzoo.kernels.index_scan.sketch_query`), one scan
    for the bounds and the estimates (the query rows without eta's and the slack columns), each query row's top ``j``
    by the ranking score, kept where the bound is above ``floor``, then :func:`unique_candidates` and the count."""
    B, G, hq, D = query.shape
    dc, r = basis.shape[2], basis.shape[3]
    heads = query.reshape(B, G * hq, 1, D)  # sketch_query groups the heads again: [B, G, hq, W]
    branch = heads[..., dc:] if D > dc else None
    qrows = sketch_query(heads[..., :dc], branch, basis, slack=slack)
    if rank_by == "estimate":
        W = qrows.shape[-1]
        in_span = qrows.clone()
        in_span[..., [r, *range(W - (2 if branch is not None else 1), W)]] = 0  # eta's column and the slack's
        both = index_scan(torch.cat([qrows, in_span], dim=2), entries, scaling, length=length)  # one scan
        bounds, ranking = both[:, :, :hq], both[:, :, hq:]
        rows = ranking.topk(j, dim=-1).indices  # [B, G, hq, j]
        ok = bounds.gather(-1, rows) > floor[..., None]
    else:
        bounds = index_scan(qrows, entries, scaling, length=length)
        top, rows = bounds.topk(j, dim=-1)
        ok = top > floor[..., None]
    idx, picked = unique_candidates(rows.view(B, G, -1), ok.view(B, G, -1), archived)
    return idx, picked, _counted(picked, counter)


def sketch_choose(query: torch.Tensor, basis: torch.Tensor, entries: torch.Tensor, floor: torch.Tensor, j: int,
                  archived: int, scaling: float, *, slack: float = SKETCH_SLACK, rank_by: str = "estimate",
                  length: torch.Tensor | None = None,
                  counter: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """VestigeKV's top-j rule over its sketch for grouped decode queries: ``(idx, picked) [B, G, hq * j]`` and
    ``count``.

    ``query [B, G, hq, D]`` fp32 (MLA: ``D = dc + dr``, the absorbed content part first; GQA: the key's width, no
    branch), ``basis [B, G, dc, r]`` orthonormal columns, ``entries [B, G, m, W]`` fp32 or fp16 (``[z, eta, r, ||c||,
    ||r||]``: ``W = r + 1 + dr + 2``, or ``r + 2`` on GQA; a preallocated buffer may be passed whole with
    ``length [B]``), ``floor [B, G, hq]`` (``s* - j_margin``), ``j <= m``, ``archived`` (the archive list's size: the
    staging's sentinel, as :func:`unique_candidates`), ``slack`` (``SKETCH_SLACK``, or ``SKETCH_SLACK_FP16`` for fp16
    entries), ``rank_by`` ``"estimate"`` (the bound less its Cauchy-Schwarz term and slack) or ``"bound"``.

    Per query row: the estimate (or bound) of every entry, its top ``j`` (an earlier row first among equal values),
    each kept where its bound is above ``floor``; the group's ``hq * j`` candidates staged (sorted, each kept row
    flagged once); ``count`` the rows picked, added to ``counter`` in place when given. One C call on CPU tensors
    (``cpu_native.sketch_choose_supported``), :func:`sketch_choose_reference` elsewhere."""
    if rank_by not in RANK_BY:
        raise ValueError(f"rank_by must be one of {RANK_BY}, got {rank_by!r}")
    if mode() != "torch" and cpu_native.sketch_choose_supported(query, basis, entries, floor, j, counter):
        return cpu_native.sketch_choose(query, basis, entries, length, floor, j, archived, scaling, slack,
                                        rank_by == "bound", counter)
    return sketch_choose_reference(query, basis, entries, floor, j, archived, scaling, slack=slack, rank_by=rank_by,
                                   length=length, counter=counter)
