"""Attention of a forward of several queries over rows that carry their own sequence slots (PyTorch).

A decode step goes through the decode-attention op instead (``kvzoo/kernels/decode_attention/``). After eviction a
tier holds an arbitrary subset of the sequence, so causality and padding are decided per row from its *slot* (its
index in the sequence) and its ``valid`` flag, never from its index in the tensor. Shapes: ``B`` batch, ``H`` query
heads, ``G`` KV groups, ``q`` queries, ``n`` rows, ``D`` key width, ``Dv`` value width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvzoo.kernels.decode_attention import sdpa as decode_sdpa

# Most fp32 elements one score block may hold (B x H x queries x rows): 2**24 floats = 64 MiB. Every
# reference below that materialises scores works through the queries in blocks of at most this many.
SCORE_BLOCK_ELEMENTS = 1 << 24


def query_block(batch_heads: int, rows: int, budget: int = SCORE_BLOCK_ELEMENTS) -> int:
    """How many queries one score block of ``batch_heads x queries x rows`` fp32 may hold (>= 1)."""
    return max(1, budget // max(1, batch_heads * rows))


def row_mask(key_slots: torch.Tensor, key_valid: torch.Tensor, query_slots: torch.Tensor) -> torch.Tensor:
    """Bool ``[B, G, q, n]``: query at slot s may read a row iff the row is valid and its slot <= s, and always
    its own row (slot == s), so a padding query has a defined (ignored) output instead of NaN."""
    ks = key_slots[:, :, None, :]  # [B, G, 1, n]
    qs = query_slots.view(1, 1, -1, 1)  # [1, 1, q, 1]
    return (key_valid[:, :, None, :] & (ks <= qs)) | (ks == qs)


def received_attention(probs: torch.Tensor, groups: int) -> torch.Tensor:
    """H2O's accumulation, the one statement of it in kvzoo: ``[B, groups, n]`` fp32, the probability each row
    received summed over the queries and the query heads of its group, from ``probs [B, H, ..., n]`` (a group's heads
    consecutive, as transformers lays them out) or per-group sums ``[B, G', n]`` folded into fewer groups (MLA)."""
    B, n = probs.shape[0], probs.shape[-1]
    return probs.reshape(B, groups, -1, n).sum(dim=2)


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
    query_chunk: int | None = None,
    extra_mask: torch.Tensor | None = None,
    bottom_right: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Softmax attention of ``query [B,H,q,D]`` over rows ``keys [B,G,n,D]``, ``values [B,G,n,Dv]``: ``[B, H, q, Dv]``
    in the query's dtype, and with ``column_sums`` each row's received probability ``[B, G, n]`` (H2O's accumulator).
    ``extra_mask [B, G, q, n]`` restricts it further. ``bottom_right=True`` promises the bottom-right causal case (no
    padding, slot order, the queries' own rows last): a block of queries scores only the rows its last query reaches.
    Queries go ``query_chunk`` at a time (default: :func:`query_block`)."""
    B, H, q_len, D = query.shape
    G, n = keys.shape[1], keys.shape[2]
    out = torch.empty(B, H, q_len, values.shape[-1], dtype=query.dtype, device=query.device)
    sums = torch.zeros(B, G, n, dtype=torch.float32, device=query.device) if column_sums else None
    query_chunk = query_chunk or query_block(B * H, n)
    for start in range(0, q_len, query_chunk):
        stop = min(start + query_chunk, q_len)
        reach = n - q_len + stop if bottom_right else n  # the rows the block's last query may read
        allowed = row_mask(key_slots[..., :reach], key_valid[..., :reach], query_slots[start:stop])  # [B, G, c, reach]
        if extra_mask is not None:
            allowed = allowed & extra_mask[:, :, start:stop, :reach]
        scores = row_scores(query[:, :, start:stop], keys[:, :, :reach], scaling, allowed)
        out[:, :, start:stop], _, (probs,) = attend_scores([scores], [values[:, :, :reach]], query.dtype)
        if sums is not None:
            sums[..., :reach] += received_attention(probs, G)
    return out, sums


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
    extra_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same output as :func:`attention_reference` through torch's fused SDPA (no probabilities).

    ``all_valid=True`` promises no padding row, rows in slot order, and this forward's own rows last (an ordered
    tier). The mask is then the bottom-right causal one, never materialised where avoidable: ``is_causal`` when ``q ==
    n`` (on CPU a ``CausalBias`` there cost 137 MiB more at 4,096 tokens), ``causal_lower_right`` on CUDA, a ``[q,
    n]`` bool mask on CPU. Otherwise the slot mask is built.
    """
    B, H, q_len, _ = query.shape
    G, n = keys.shape[1], keys.shape[2]
    hpg = H // G
    if all_valid and extra_mask is None:
        if q_len == 1:  # one query sees every row: the decode op's fused form, no mask
            return decode_sdpa.fused(query[:, :, 0], keys, values, scaling)[:, :, None]
        if q_len == n:  # lower-right is upper-left here: the causal kernel, nothing materialised
            return F.scaled_dot_product_attention(query, keys, values, is_causal=True, scale=scaling,
                                                  enable_gqa=hpg > 1)
        if query.device.type != "cuda":
            # on CPU a CausalBias is materialised by the op (in fp32 and more: 28 MiB for 512 queries over 4,096 rows,
            # 11 MiB as a bool mask, the same time)
            mask = torch.ones(q_len, n, dtype=torch.bool, device=query.device).tril(n - q_len)
            return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scaling,
                                                  enable_gqa=hpg > 1)
        # imported here: the module costs ~2 s of torch._dynamo to import
        from torch.nn.attention.bias import causal_lower_right

        if hpg > 1:  # the lower-right kernels take equal head counts
            keys, values = keys.repeat_interleave(hpg, dim=1), values.repeat_interleave(hpg, dim=1)
        return F.scaled_dot_product_attention(query, keys, values, attn_mask=causal_lower_right(q_len, n),
                                              scale=scaling)
    allowed = row_mask(key_slots, key_valid, query_slots)  # [B, G, q, n]
    if extra_mask is not None:
        allowed = allowed & extra_mask
    allowed = allowed[:, :, None].expand(B, G, hpg, q_len, n).reshape(B, H, q_len, n)
    return F.scaled_dot_product_attention(query, keys, values, attn_mask=allowed, scale=scaling, enable_gqa=hpg > 1)


def row_scores(query: torch.Tensor, keys: torch.Tensor, scaling: float, allowed: torch.Tensor | None = None) -> torch.Tensor:
    """``scale * <q, k>`` ``[B, H, q, n]`` in fp32, ``-inf`` where ``allowed [B, G, q|1, n]`` is False: the product
    in the rows' dtype (fp32 accumulation, as transformers' attention), only the scores upcast."""
    B, H, q_len, D = query.shape
    G, n = keys.shape[1], keys.shape[2]
    hpg = H // G
    q = query.to(keys.dtype).reshape(B, G, hpg * q_len, D)  # a group's heads and queries share its rows
    scores = torch.matmul(q, keys.transpose(-1, -2)).view(B, G, hpg, q_len, n).float() * scaling
    if allowed is not None:
        scores = scores.masked_fill(~allowed[:, :, None], float("-inf"))
    return scores.view(B, H, q_len, n)


def attend_scores(
    scores: list[torch.Tensor], values: list[torch.Tensor], out_dtype: torch.dtype, *, with_lse: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None, list[torch.Tensor]]:
    """One softmax over several row sources, merged exactly: ``scores[i] [B, H, q, n_i]`` (fp32, ``-inf`` where
    unreadable), ``values[i] [B, G, n_i, Dv]`` -> ``(out [B, H, q, Dv] in out_dtype, lse [B, H, q] or None, each
    source's probabilities)``; the probabilities cast to the values' dtype for the products, as transformers does."""
    joined = torch.cat(scores, dim=-1) if len(scores) > 1 else scores[0]
    probs = torch.softmax(joined, dim=-1)
    lse = torch.logsumexp(joined, dim=-1) if with_lse else None
    parts = probs.split([s.shape[-1] for s in scores], dim=-1) if len(scores) > 1 else [probs]
    B, H, q_len, _ = joined.shape
    out = None
    for p, v in zip(parts, values):
        G = v.shape[1]
        term = torch.matmul(p.to(v.dtype).reshape(B, G, (H // G) * q_len, -1), v)
        out = term if out is None else out + term
    return out.view(B, H, q_len, -1).to(out_dtype), lse, list(parts)


def window_attention(
    queries: torch.Tensor,
    query_slots: torch.Tensor,
    keys: torch.Tensor,
    key_slots: torch.Tensor,
    key_valid: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """Probabilities ``[B, H, w, n]`` (fp32) of ``w`` observation-window queries over the rows: ``w x n``, never
    ``n x n`` (SnapKV/ChunkKV only need the last window's attention)."""
    B, H, w, D = queries.shape
    G = keys.shape[1]
    q = queries.float().view(B, G, H // G, w, D)
    scores = torch.einsum("bghqd,bgnd->bghqn", q, keys.float()) * scaling
    allowed = row_mask(key_slots, key_valid, query_slots)[:, :, None]  # [B, G, 1, w, n]
    return torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1).view(B, H, w, -1)
