"""Decode attention through torch's fused ``scaled_dot_product_attention`` where it applies (one source, read whole,
nothing but the output asked: transformers' own decode), and the same math in two products elsewhere: per source
fp32 scores, one fp32 softmax over every source of the step, the probabilities in the values' dtype times the
values. Held to the reference (``tests/test_decode_attention_reference.py``) on single-part and two-part steps.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvzoo.kernels.decode_attention.rows import Attended, _group_readable, _readable, _Source
from kvzoo.kernels.index_scan import _upcast_matmul


def sdpa_mask(query: torch.Tensor, s: _Source) -> torch.Tensor | None:
    """Bool ``[B, H, 1, N']`` of the positions each head may read (None: every position)."""
    src = s.rows
    if src.valid is None and src.length is None and src.indices is None and src.head_valid is None:
        return None
    B, H = query.shape[:2]
    allowed = _group_readable(query, s)  # [B, G, N']
    if src.head_valid is None:
        hpg = H // s.groups
        return allowed[:, :, None, None, :].expand(B, s.groups, hpg, 1, s.positions).reshape(B, H, 1, s.positions)
    return _readable(allowed, s, H)[:, :, None, :]


def _sdpa_rows(s: _Source, value: bool) -> torch.Tensor:
    """A source's keys (or values) ``[B, G, N', *]`` in their dtype: the pool, or its gathered rows."""
    src = s.rows
    pool = src.values if value and src.values is not None else src.keys
    if value and src.values is None:
        pool = pool[..., : s.value_width]
    if src.indices is None:
        return pool
    idx = src.indices.to(torch.int64).clamp(0, max(s.pool - 1, 0))
    return torch.gather(pool, 2, idx[..., None].expand(*idx.shape, pool.shape[-1]))


def fused(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float,
          mask: torch.Tensor | None = None) -> torch.Tensor:
    """Torch's fused SDPA of one query per sequence ``[B, H, D]`` over ``keys [B, G, N, D]``, ``values [B, G, N, Dv]``
    (read in place, ``enable_gqa``: transformers' own decode) under ``mask [B, H, 1, N]`` (None: every row)."""
    q = query.to(keys.dtype)[:, :, None]
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scaling,
                                         enable_gqa=query.shape[1] > keys.shape[1])
    return out[:, :, 0]


def _scores(q: torch.Tensor, keys: torch.Tensor, scaling: float) -> torch.Tensor:
    """``scaling * q k^T`` ``[B, G, hpg, N']`` fp32 for ``q [B, G, hpg, D]`` in the rows' dtype; half-precision rows
    are upcast a block at a time, so the product is fp32's (the score precision of every path that computes s*)."""
    if keys.dtype == torch.float32:
        return torch.matmul(q, keys.transpose(-1, -2)).mul_(scaling)
    return _upcast_matmul(q.float(), keys).mul_(scaling)


def attend_sdpa(query: torch.Tensor, checked: list[_Source], scaling: float, *, lse: bool = False,
                best: bool = False, mass: bool = False, defer: bool = False,
                prior: Attended | None = None) -> Attended:
    """One source without extras through :func:`fused`; otherwise per source fp32 scores (:func:`_scores`), one fp32
    softmax over every source (``prior``'s deferred scores included, or a prior's ``(out, lse)`` as one term, as in
    the reference), the probabilities in the values' dtype times the values. ``defer``: stop after the scores.

    Unlike the reference and the kernel, this path multiplies an unreadable row's value by its zero probability:
    unreadable rows must hold finite values (the runtime's always do); a NaN there would reach the output."""
    B, H, D = query.shape
    if len(checked) == 1 and prior is None and not (lse or best or mass or defer) \
            and checked[0].pool == checked[0].positions:
        s = checked[0]
        return Attended(fused(query, _sdpa_rows(s, False), _sdpa_rows(s, True), scaling, sdpa_mask(query, s)))
    scores = []
    for s in checked:
        keys = _sdpa_rows(s, False)
        G, hpg = s.groups, H // s.groups
        sc = _scores(query.to(keys.dtype).view(B, G, hpg, D), keys, scaling)  # [B, G, hpg, N'] fp32
        src = s.rows
        if src.head_valid is not None:  # a flag per head
            sc = sc.view(B, H, s.positions).masked_fill_(~sdpa_mask(query, s)[:, :, 0], float("-inf"))
        elif src.valid is not None or src.length is not None or src.indices is not None:  # one flag per group row
            sc = sc.masked_fill_(~_group_readable(query, s)[:, :, None], float("-inf")).view(B, H, s.positions)
        scores.append(sc.view(B, H, s.positions))
    best_t = None
    if best:
        best_t = torch.stack([sc.amax(dim=-1) for sc in scores]).amax(0) if len(scores) > 1 else scores[0].amax(-1)
    if defer:
        return Attended(None, best=best_t, scores=scores, sources=checked)
    merged = prior is not None and prior.scores is None  # a kernel's or the native op's part: (out, lse)
    if prior is not None and not merged:
        scores, checked = prior.scores + scores, prior.sources + checked
    joined = torch.cat(scores, dim=-1) if len(scores) > 1 else scores[0]
    if merged:
        joined = torch.cat([prior.lse[..., None], joined], dim=-1)
    # 0 (not NaN) where a head may read no row: out = 0 there (the aten op: torch.compile traces it)
    probs = torch.ops.aten._safe_softmax.default(joined, -1)
    if merged:
        weight, probs = probs[..., :1], probs[..., 1:]  # the prior's share of the step [B, H, 1]
    parts = probs.split([s.positions for s in checked], dim=-1) if len(checked) > 1 else [probs]
    out = None
    for s, p in zip(checked, parts):
        values = _sdpa_rows(s, True)
        G = s.groups
        term = torch.matmul(p.to(values.dtype).view(B, G, H // G, s.positions), values)
        out = term if out is None else out + term
    out = out.view(B, H, -1)
    masses = list(parts) if mass else None
    if merged:
        out = out.float() + torch.where(weight > 0, weight * prior.out.float(), 0.0)
        if mass and prior.mass is not None:
            masses = [m * weight for m in prior.mass] + masses
    lse_t = torch.logsumexp(joined, dim=-1) if lse else None  # -inf where no row is readable
    return Attended(out, lse_t, best_t if prior is None else prior.best, masses)

