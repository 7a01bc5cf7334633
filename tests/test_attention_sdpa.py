"""``attention_sdpa``'s ordered-tier fast path (``all_valid=True``: no padding, rows in slot order, this forward's
rows last) against ``attention_reference``: a context's one forward (``q == n``, the fused causal kernel), a chunk
after earlier rows (``q < n``: a bool mask on CPU), one query; grouped heads and not."""

from __future__ import annotations

import pytest
import torch

from kvzoo.kernels.attention import attention_reference, attention_sdpa


@pytest.mark.parametrize("hpg", [1, 3])
@pytest.mark.parametrize(("q_len", "n"), [(40, 40), (16, 40), (1, 40), (40, 41)])
def test_the_ordered_fast_path_matches_the_reference(hpg, q_len, n):
    g = torch.Generator().manual_seed(q_len * 100 + n + hpg)
    B, G, D = 2, 2, 16
    query = torch.randn(B, G * hpg, q_len, D, generator=g)
    keys, values = torch.randn(B, G, n, D, generator=g), torch.randn(B, G, n, D, generator=g)
    slots = torch.arange(n).expand(B, G, n)
    valid = torch.ones(B, G, n, dtype=torch.bool)
    q_slots = torch.arange(n - q_len, n)
    want, _ = attention_reference(query, keys, values, slots, valid, q_slots, D ** -0.5)
    got = attention_sdpa(query, keys, values, slots, valid, q_slots, D ** -0.5, all_valid=True)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # and the masked path (all_valid=False) agrees with both
    masked = attention_sdpa(query, keys, values, slots, valid, q_slots, D ** -0.5)
    torch.testing.assert_close(masked, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("q_len", "n", "chunk"), [(40, 40, 7), (16, 40, 5), (40, 40, None)])
def test_the_reference_scores_only_the_rows_a_bottom_right_block_reaches(q_len, n, chunk):
    """``bottom_right=True`` (a causal prefill, H2O's accumulating one): each block of queries scores the rows its last
    query reaches; the output and the rows' received attention equal the whole-row computation's, the rows past the
    block's reach receiving nothing."""
    g = torch.Generator().manual_seed(q_len + n)
    B, G, hpg, D = 1, 2, 2, 16
    query = torch.randn(B, G * hpg, q_len, D, generator=g)
    keys, values = torch.randn(B, G, n, D, generator=g), torch.randn(B, G, n, D, generator=g)
    slots = torch.arange(n).expand(B, G, n)
    valid = torch.ones(B, G, n, dtype=torch.bool)
    q_slots = torch.arange(n - q_len, n)
    want, want_sums = attention_reference(query, keys, values, slots, valid, q_slots, D ** -0.5, column_sums=True,
                                          query_chunk=chunk)
    got, sums = attention_reference(query, keys, values, slots, valid, q_slots, D ** -0.5, column_sums=True,
                                    query_chunk=chunk, bottom_right=True)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(sums, want_sums, rtol=1e-6, atol=1e-6)
    assert sums.sum().item() == pytest.approx(G * hpg * q_len, rel=1e-5)  # every query's probability, once
