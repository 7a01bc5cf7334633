"""Index scans over the archive (PyTorch reference): certified sketch bounds and Quest page bounds.

Both return *upper bounds* on the attention score ``scale * <q, k>`` of archived rows, computed
from a small index instead of the rows themselves; the retrieval tier fetches the rows whose
bounds say they could matter. Shapes: ``B`` batch, ``G`` KV groups, ``H`` query heads
(``H % G == 0``), ``q`` queries, ``m`` archived rows, ``p`` pages, ``rank`` sketch rank.
"""

from __future__ import annotations

import torch

# Relative slack added to every sketch bound so that fp32 rounding can never make it undercut
# the exact fp32 score (the bound is exact arithmetic's; the slack is ~100x fp32's epsilon).
SKETCH_SLACK = 1e-5


def sketch_bounds(
    q_content: torch.Tensor,
    q_branch: torch.Tensor | None,
    basis: torch.Tensor,
    z: torch.Tensor,
    eta: torch.Tensor,
    branch: torch.Tensor | None,
    scaling: float,
) -> torch.Tensor:
    """VestigeKV's certified bound ``[B, H, q, m]`` (paper §4.2, Lemma 2), fp32.

    ``q_content [B,H,q,dc]`` (MLA: the absorbed query ``W_UK^T q_nope``; GQA: the query),
    ``q_branch [B,H,q,dr]`` or None (GQA has no branch), ``basis [G, dc, rank]`` orthonormal
    columns, ``z [B,G,m,rank] = V^T c``, ``eta [B,G,m] = ||(I - V V^T) c||``, ``branch [B,G,m,dr]``.

        bound = scale * (<q_r, r> + <V^T q_c, z> + ||(I - V V^T) q_c|| * eta)  >=  scale * <q, [c; r]>

    by Cauchy-Schwarz on the component of ``q_c`` and ``c`` outside span(V).
    """
    B, H, q_len, dc = q_content.shape
    G = basis.shape[0]
    hpg = H // G
    qc = q_content.float().view(B, G, hpg, q_len, dc)
    qz = torch.einsum("bghqd,gdr->bghqr", qc, basis.float())  # [B,G,hpg,q,rank]
    resid = (qc - torch.einsum("bghqr,gdr->bghqd", qz, basis.float())).norm(dim=-1)  # [B,G,hpg,q]
    bound = torch.einsum("bghqr,bgmr->bghqm", qz, z.float()) + resid[..., None] * eta.float()[:, :, None, None, :]
    c_norm = (z.float().pow(2).sum(-1) + eta.float().pow(2)).sqrt()  # ||c|| from the index alone
    slack = qc.norm(dim=-1)[..., None] * c_norm[:, :, None, None, :]
    if q_branch is not None:
        qr = q_branch.float().view(B, G, hpg, q_len, -1)
        bound = bound + torch.einsum("bghqd,bgmd->bghqm", qr, branch.float())
        slack = slack + qr.norm(dim=-1)[..., None] * branch.float().norm(dim=-1)[:, :, None, None, :]
    bound = bound + SKETCH_SLACK * slack
    return (scaling * bound).reshape(B, H, q_len, -1)


def page_bounds(query: torch.Tensor, page_min: torch.Tensor, page_max: torch.Tensor, scaling: float) -> torch.Tensor:
    """Quest's bound ``[B, H, q, p]``: ``scale * sum_i max(q_i * min_i, q_i * max_i)`` per page, fp32.

    ``query [B,H,q,D]``, ``page_min``/``page_max [B,G,p,D]`` element-wise over each page's keys.
    For any key k in the page, ``q_i k_i <= max(q_i min_i, q_i max_i)`` for every i, so the sum
    bounds ``<q, k>`` (Quest, ICML 2024, §3.2). Costs ``2 p D`` instead of ``16 p D``.
    """
    B, H, q_len, D = query.shape
    G = page_min.shape[1]
    q = query.float().view(B, G, H // G, q_len, 1, D)
    lo, hi = page_min.float()[:, :, None, None], page_max.float()[:, :, None, None]  # [B,G,1,1,p,D]
    bound = torch.maximum(q * lo, q * hi).sum(-1)  # [B,G,hpg,q,p]
    bound = bound + SKETCH_SLACK * (q.abs() * torch.maximum(lo.abs(), hi.abs())).sum(-1)
    return (scaling * bound).reshape(B, H, q_len, -1)


def exact_scores(query: torch.Tensor, keys: torch.Tensor, scaling: float) -> torch.Tensor:
    """``scale * <q, k>`` ``[B, H, q, m]`` fp32 for rows ``keys [B, G, m, D]`` (audits and s*)."""
    B, H, q_len, D = query.shape
    G = keys.shape[1]
    q = query.float().view(B, G, H // G, q_len, D)
    return (scaling * torch.einsum("bghqd,bgmd->bghqm", q, keys.float())).reshape(B, H, q_len, -1)
