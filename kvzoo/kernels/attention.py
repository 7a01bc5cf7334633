"""Attention over a tier of rows that carry their own sequence slots (PyTorch reference).

This is the specification the Triton kernels of a later issue are held against. Rows are not
contiguous positions: after eviction, a tier holds an arbitrary subset of the sequence, so
causality and padding are decided per row from its *slot* (its index in the sequence) and its
``valid`` flag, never from its index in the tensor.

Shapes: ``B`` batch, ``H`` query heads, ``G`` KV groups (``H % G == 0``), ``q`` queries,
``n`` rows, ``D`` key width, ``Dv`` value width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def row_mask(key_slots: torch.Tensor, key_valid: torch.Tensor, query_slots: torch.Tensor) -> torch.Tensor:
    """Bool ``[B, G, q, n]``: query at slot s may read a row iff the row is valid and its slot <= s.

    A query always reads its own row (slot == s) even when it is padding, so a padding query has
    a defined (ignored) output instead of NaN.
    """
    ks = key_slots[:, :, None, :]  # [B, G, 1, n]
    qs = query_slots.view(1, 1, -1, 1)  # [1, 1, q, 1]
    return (key_valid[:, :, None, :] & (ks <= qs)) | (ks == qs)


def masked_probs(
    query: torch.Tensor, keys: torch.Tensor, key_slots: torch.Tensor, key_valid: torch.Tensor,
    query_slots: torch.Tensor, scaling: float,
) -> torch.Tensor:
    """Softmax ``[B, G, H/G, q, n]`` (fp32) of ``query [B,G,H/G,q,D]`` (fp32) over ``keys [B,G,n,D]``."""
    scores = torch.einsum("bghqd,bgnd->bghqn", query, keys.float()) * scaling
    allowed = row_mask(key_slots, key_valid, query_slots)[:, :, None]  # [B,G,1,q,n]
    return torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)


def attention_reference(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    key_slots: torch.Tensor,
    key_valid: torch.Tensor,
    query_slots: torch.Tensor,
    scaling: float,
    *,
    column_sums: bool = False,
    query_chunk: int = 512,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Softmax attention of ``query [B,H,q,D]`` over rows ``keys [B,G,n,D]``, ``values [B,G,n,Dv]``.

    Scores and softmax accumulate in fp32; the output has the query's dtype, ``[B, H, q, Dv]``.
    With ``column_sums=True`` also returns ``[B, G, n]`` fp32: the attention probability each row
    received, summed over the queries and over the query heads of its group (H2O's accumulator).
    Queries are processed ``query_chunk`` at a time, so the score matrix never exceeds
    ``B * H * query_chunk * n`` floats.
    """
    B, H, q_len, D = query.shape
    G, n = keys.shape[1], keys.shape[2]
    hpg = H // G
    q = query.float().view(B, G, hpg, q_len, D)
    k = keys.float()
    v = values.float()
    out = torch.empty(B, G, hpg, q_len, values.shape[-1], dtype=torch.float32, device=query.device)
    sums = torch.zeros(B, G, n, dtype=torch.float32, device=query.device) if column_sums else None
    for start in range(0, q_len, query_chunk):
        stop = min(start + query_chunk, q_len)
        probs = masked_probs(q[:, :, :, start:stop], k, key_slots, key_valid, query_slots[start:stop], scaling)
        out[:, :, :, start:stop] = torch.einsum("bghqn,bgnv->bghqv", probs, v)
        if sums is not None:
            sums += probs.sum(dim=(2, 3))
    return out.view(B, H, q_len, -1).to(query.dtype), sums


def attention_sdpa(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    key_slots: torch.Tensor,
    key_valid: torch.Tensor,
    query_slots: torch.Tensor,
    scaling: float,
    *,
    all_valid: bool = False,
) -> torch.Tensor:
    """Same output as :func:`attention_reference` through torch's fused SDPA (no probabilities).

    ``all_valid=True`` promises no padding row and rows in slot order ending at the last query
    (true for any tier: new rows are appended at the end); the mask is then skipped where it is
    trivial -- a single query sees every row, and a first forward (``q == n``) is plain causal --
    which lets SDPA take its fused kernels.
    """
    B, H, q_len, _ = query.shape
    G, n = keys.shape[1], keys.shape[2]
    hpg = H // G
    if all_valid and (q_len == 1 or q_len == n):
        return F.scaled_dot_product_attention(
            query, keys, values, is_causal=q_len > 1, scale=scaling, enable_gqa=hpg > 1
        )
    allowed = row_mask(key_slots, key_valid, query_slots)  # [B, G, q, n]
    allowed = allowed[:, :, None].expand(B, G, hpg, q_len, n).reshape(B, H, q_len, n)
    return F.scaled_dot_product_attention(query, keys, values, attn_mask=allowed, scale=scaling, enable_gqa=hpg > 1)


def window_attention(
    queries: torch.Tensor,
    query_slots: torch.Tensor,
    keys: torch.Tensor,
    key_slots: torch.Tensor,
    key_valid: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """Probabilities ``[B, H, w, n]`` (fp32) of ``w`` observation-window queries over the rows.

    Costs ``w x n``, never ``n x n``: SnapKV/ChunkKV only need the last window's attention.
    """
    B, H, w, D = queries.shape
    G = keys.shape[1]
    q = queries.float().view(B, G, H // G, w, D)
    return masked_probs(q, keys, key_slots, key_valid, query_slots, scaling).view(B, H, w, -1)
