"""Index scans over the archive (PyTorch reference): certified sketch bounds and Quest page bounds.

Both return *upper bounds* on the attention score ``scale * <q, k>`` of archived rows, computed
from a small index instead of the rows themselves; the retrieval tier fetches the rows whose
bounds say they could matter. Shapes: ``B`` batch, ``G`` KV groups, ``H`` query heads
(``H % G == 0``), ``q`` queries, ``m`` archived rows, ``p`` pages, ``rank`` sketch rank.

Both bounds are one inner product per (query, entry): each index entry is a row of a matrix
``E [B, G, m, W]`` and each query becomes a row ``Q [B, G, hpg * q, W]`` (:func:`sketch_query`,
:func:`page_query`), so a scan is ``scale * Q @ E^T`` (:func:`index_scan`) -- one product, whatever
the retriever, and the operation the fused Triton scan implements. Every term of the bound,
including its float slack, is a column of ``E``.

Memory: a scan's output is ``[B, H, q, m]`` fp32 and no intermediate is larger than that or than
:data:`ROW_BLOCK_ELEMENTS` -- never ``queries x rows x dims``. Callers scan a long forward in query
tiles (:func:`kvzoo.kernels.attention.query_block`), so a scan's extra memory is one tile of scores
plus ``O(rows)``, whatever the number of queries.
"""

from __future__ import annotations

import torch

# Relative slack added to every bound so that fp32 rounding can never make it undercut the exact
# fp32 score (the bound is exact arithmetic's; the slack is ~100x fp32's epsilon).
SKETCH_SLACK = 1e-5
# Most elements of an fp32 copy of index or archive rows made at once (rows are upcast in blocks).
ROW_BLOCK_ELEMENTS = 1 << 22


def _row_blocks(total: int, per_row: int) -> list[tuple[int, int]]:
    step = max(1, ROW_BLOCK_ELEMENTS // max(1, per_row))
    return [(start, min(start + step, total)) for start in range(0, total, step)]


def index_scan(query_rows: torch.Tensor, entries: torch.Tensor, scaling: float) -> torch.Tensor:
    """``scale * Q @ E^T`` ``[B, G, hq, m]`` fp32 for ``Q [B, G, hq, W]`` (fp32) and ``E [B, G, m, W]``.

    ``E`` may be stored in any float dtype; it is upcast in blocks of rows, so the product is
    fp32's and the extra memory is one block.
    """
    B, G, hq, W = query_rows.shape
    m = entries.shape[2]
    q = query_rows.float()
    if entries.dtype == torch.float32:
        out = torch.matmul(q, entries.transpose(-1, -2))
    else:
        out = q.new_empty(B, G, hq, m)
        for start, stop in _row_blocks(m, B * G * W):
            out[..., start:stop] = torch.matmul(q, entries[:, :, start:stop].float().transpose(-1, -2))
    return out.mul_(scaling)


def _grouped(query: torch.Tensor, groups: int) -> torch.Tensor:
    """``[B, H, q, D]`` -> ``[B, G, hpg * q, D]`` fp32: a group's heads and queries share its rows."""
    B, H, q_len, D = query.shape
    return query.float().reshape(B, groups, (H // groups) * q_len, D)


def sketch_entries(content: torch.Tensor, branch: torch.Tensor | None, basis: torch.Tensor) -> torch.Tensor:
    """Index rows ``E = [z, eta, r, ||c||, ||r||]`` ``[B, G, m, rank + 1 + dr + 2]`` fp32.

    ``content [B,G,m,dc]`` (MLA: the latent c; GQA: the key), ``branch [B,G,m,dr]`` or None
    (then ``E = [z, eta, ||c||]``), ``basis [B|1, G, dc, rank]`` orthonormal columns.
    ``z = V^T c``, ``eta = ||(I - V V^T) c||``.
    """
    V = basis.float() if basis.dim() == 4 else basis.float()[None]
    c = content.float()
    z = torch.matmul(c, V)
    eta = (c - torch.matmul(z, V.transpose(-1, -2))).norm(dim=-1, keepdim=True)
    parts = [z, eta]
    if branch is not None:
        r = branch.float()
        parts += [r, c.norm(dim=-1, keepdim=True), r.norm(dim=-1, keepdim=True)]
    else:
        parts.append(c.norm(dim=-1, keepdim=True))
    return torch.cat(parts, dim=-1)


def sketch_query(q_content: torch.Tensor, q_branch: torch.Tensor | None, basis: torch.Tensor) -> torch.Tensor:
    """Query rows ``Q = [V^T q_c, ||(I - V V^T) q_c||, q_r, eps ||q_c||, eps ||q_r||]`` ``[B, G, hpg*q, W]``.

    ``Q . E = <q_r, r> + <V^T q_c, z> + ||q_perp|| eta + eps (||q_c|| ||c|| + ||q_r|| ||r||)``: the
    certified bound (Cauchy-Schwarz on the part of ``q_c`` and ``c`` outside span(V)) plus the slack
    that keeps fp32 rounding from undercutting the exact score.
    """
    V = basis.float() if basis.dim() == 4 else basis.float()[None]
    G = V.shape[1]
    qc = _grouped(q_content, G)
    qz = torch.matmul(qc, V)
    resid = (qc - torch.matmul(qz, V.transpose(-1, -2))).norm(dim=-1, keepdim=True)
    parts = [qz, resid]
    if q_branch is not None:
        qr = _grouped(q_branch, G)
        parts += [qr, SKETCH_SLACK * qc.norm(dim=-1, keepdim=True), SKETCH_SLACK * qr.norm(dim=-1, keepdim=True)]
    else:
        parts.append(SKETCH_SLACK * qc.norm(dim=-1, keepdim=True))
    return torch.cat(parts, dim=-1)


def sketch_bounds(
    q_content: torch.Tensor,
    q_branch: torch.Tensor | None,
    basis: torch.Tensor,
    z: torch.Tensor,
    eta: torch.Tensor,
    branch: torch.Tensor | None,
    scaling: float,
) -> torch.Tensor:
    """VestigeKV's certified bound ``[B, H, q, m]`` (paper §4.2, Lemma 2), fp32, from the index parts.

    ``q_content [B,H,q,dc]`` (MLA: the absorbed query ``W_UK^T q_nope``; GQA: the query),
    ``q_branch [B,H,q,dr]`` or None (GQA has no branch), ``basis [B|1, G, dc, rank]`` (or
    ``[G, dc, rank]``) orthonormal columns, ``z [B,G,m,rank] = V^T c``,
    ``eta [B,G,m] = ||(I - V V^T) c||``, ``branch [B,G,m,dr]``.

        bound = scale * (<q_r, r> + <V^T q_c, z> + ||(I - V V^T) q_c|| * eta)  >=  scale * <q, [c; r]>

    by Cauchy-Schwarz on the component of ``q_c`` and ``c`` outside span(V).
    """
    B, H, q_len, _ = q_content.shape
    zf, etaf = z.float(), eta.float()[..., None]
    c_norm = (zf.pow(2).sum(-1, keepdim=True) + etaf.pow(2)).sqrt()  # ||c|| from the index alone
    if branch is not None:
        rf = branch.float()
        entries = torch.cat([zf, etaf, rf, c_norm, rf.norm(dim=-1, keepdim=True)], dim=-1)
    else:
        entries = torch.cat([zf, etaf, c_norm], dim=-1)
    bound = index_scan(sketch_query(q_content, q_branch, basis), entries, scaling)
    return bound.view(B, H, q_len, -1)


def page_entries(page_min: torch.Tensor, page_max: torch.Tensor) -> torch.Tensor:
    """Index rows ``E = [max, min, max_i max(|min_i|, |max_i|)]`` ``[B, G, p, 2 D + 1]`` (input dtype).

    Every entry is one of the page's key values, so storing them in the keys' dtype is exact.
    """
    magnitude = torch.maximum(page_min.abs(), page_max.abs()).amax(dim=-1, keepdim=True)
    return torch.cat([page_max, page_min, magnitude], dim=-1)


def page_query(query: torch.Tensor, groups: int) -> torch.Tensor:
    """Query rows ``Q = [max(q, 0), min(q, 0), eps ||q||_1]`` ``[B, G, hpg * q, 2 D + 1]`` fp32.

    Since ``min <= max``, ``max(q_i min_i, q_i max_i) = max(q_i, 0) max_i + min(q_i, 0) min_i``, so
    ``Q . E`` is Quest's bound ``sum_i max(q_i min_i, q_i max_i)`` plus a slack that covers fp32
    rounding (``eps ||q||_1 max |k_i| >= eps sum_i |q_i k_i|`` for every key k of the page).
    """
    q = _grouped(query, groups)
    return torch.cat([q.clamp(min=0), q.clamp(max=0), SKETCH_SLACK * q.abs().sum(-1, keepdim=True)], dim=-1)


def page_bounds(query: torch.Tensor, page_min: torch.Tensor, page_max: torch.Tensor, scaling: float) -> torch.Tensor:
    """Quest's bound ``[B, H, q, p]``: ``scale * sum_i max(q_i * min_i, q_i * max_i)`` per page, fp32.

    ``query [B,H,q,D]``, ``page_min``/``page_max [B,G,p,D]`` element-wise over each page's keys
    (any dtype). For any key k in the page, ``q_i k_i <= max(q_i min_i, q_i max_i)`` for every i,
    so the sum bounds ``<q, k>`` (Quest, ICML 2024, §3.2). Two products in one (:func:`page_query`),
    no ``q x p x D`` intermediate; it reads ``2 p D`` values instead of ``16 p D``.
    """
    B, H, q_len, _ = query.shape
    G = page_min.shape[1]
    bound = index_scan(page_query(query, G), page_entries(page_min, page_max), scaling)
    return bound.view(B, H, q_len, -1)


def exact_scores(query: torch.Tensor, keys: torch.Tensor, scaling: float) -> torch.Tensor:
    """``scale * <q, k>`` ``[B, H, q, m]`` fp32 for rows ``keys [B, G, m, D]`` (audits and s*).

    The rows are upcast to fp32 in blocks, so the product is fp32's whatever the cache dtype.
    """
    B, H, q_len, D = query.shape
    G, m = keys.shape[1], keys.shape[2]
    q = _grouped(query, G)
    out = q.new_empty(B, G, q.shape[2], m)
    for start, stop in _row_blocks(m, B * G * D):
        out[..., start:stop] = torch.matmul(q, keys[:, :, start:stop].float().transpose(-1, -2))
    return (scaling * out).view(B, H, q_len, m)
