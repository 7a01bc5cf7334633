"""SnapKV: planted window attention -> exactly the rows the reference algorithm keeps; budgets; errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvzoo import TieredCache, registry
from kvzoo.framework.policy import RowsView
from kvzoo.kernels.attention import window_attention as window_attention_kernel
from kvzoo.models import tiny_llama
from kvzoo.pipeline import generate
from kvzoo.policies.snapkv import SnapKV


def planted_view(B: int, H: int, G: int, w: int, N: int, plants: dict, valid: torch.Tensor | None = None,
                 base: float = 0.0) -> RowsView:
    """A RowsView whose window attention, summed over the ``w`` window queries, is ``plants`` on the given rows.

    ``plants`` maps ``(batch, head, row) -> vote``; each window query gives ``vote / w`` to the row
    (rows before the window are visible to every window query). Window rows get ``base`` from the
    queries at or after them only (causal).
    """
    attn = torch.full((B, H, w, N), base)
    q_slots = torch.arange(N - w, N)
    attn = attn.masked_fill(torch.arange(N)[None, :] > q_slots[:, None], 0.0)  # a query never sees its future
    for (b, h, row), vote in plants.items():
        attn[b, h, :, row] += vote / w
    if valid is None:
        valid = torch.ones(B, G, N, dtype=torch.bool)
    keys = torch.zeros(B, G, N, 4)
    return RowsView(keys=keys, values=keys.clone(), slots=torch.arange(N).expand(B, G, N), valid=valid,
                    layer_idx=0, num_layers=1, window_attention=attn)


def kept(policy: SnapKV, rows: RowsView, keep: int) -> list:
    out = policy.select(rows, keep)
    assert out.shape == (*rows.slots.shape[:2], keep) and out.dtype == torch.long
    return out.tolist()


def window(N: int, w: int) -> list[int]:
    return list(range(N - w, N))


# --- the algorithm on hand-built caches ----------------------------------------------------------


def test_each_kv_head_keeps_its_planted_rows_and_the_window():
    N, w = 24, 4
    plants = {(0, h, r): 1.0 for h, r in ((0, 3), (1, 3), (0, 9), (1, 9), (2, 5), (3, 5), (2, 12), (3, 12))}
    rows = planted_view(1, 4, 2, w, N, plants, base=0.01)
    got = kept(SnapKV(budget=w + 2, window=w, kernel_size=1), rows, w + 2)
    assert got == [[[3, 9, *window(N, w)], [5, 12, *window(N, w)]]]


def test_max_pool_kernel_7_spreads_a_peak_three_rows_each_way():
    N, w = 40, 8
    plants = {(0, h, 10): 1.0 for h in range(2)}
    rows = planted_view(1, 2, 1, w, N, plants)
    policy = SnapKV(budget=w + 7, window=w)  # defaults: kernel 7, max pooling
    assert kept(policy, rows, w + 7) == [[[7, 8, 9, 10, 11, 12, 13, *window(N, w)]]]
    # pooled ties go to the earlier row
    assert kept(policy, rows, w + 3) == [[[7, 8, 9, *window(N, w)]]]
    # a second, weaker peak ranks after the whole first plateau
    plants[(0, 0, 25)] = 0.5
    rows = planted_view(1, 2, 1, w, N, plants)
    assert kept(policy, rows, w + 8) == [[[7, 8, 9, 10, 11, 12, 13, 22, *window(N, w)]]]


def test_pooling_pads_at_the_sequence_start():
    N, w = 30, 4
    rows = planted_view(1, 1, 1, w, N, {(0, 0, 1): 1.0})
    # rows 1-3 .. 1+3 exist only from 0 to 4: five rows carry the peak, not seven, not shifted
    assert kept(SnapKV(budget=w + 5, window=w), rows, w + 5) == [[[0, 1, 2, 3, 4, *window(N, w)]]]
    assert kept(SnapKV(budget=w + 6, window=w), rows, w + 6) == [[[0, 1, 2, 3, 4, 5, *window(N, w)]]]


def test_window_rows_are_kept_and_left_out_of_the_pooling():
    N, w = 40, 8
    first_window_row = N - w
    plants = {(0, 0, first_window_row): 50.0, (0, 0, 2): 1.0}
    rows = planted_view(1, 1, 1, w, N, plants)
    # the window's huge vote must not leak into the last prefix rows (29..31) through the pooling
    assert kept(SnapKV(budget=w + 3, window=w), rows, w + 3) == [[[0, 1, 2, *window(N, w)]]]
    # a peak on the last prefix row spreads only backwards: rows 28..31
    rows = planted_view(1, 1, 1, w, N, {(0, 0, first_window_row - 1): 1.0})
    assert kept(SnapKV(budget=w + 4, window=w), rows, w + 4) == [[[28, 29, 30, 31, *window(N, w)]]]
    # the budget is the window exactly: only the window stays
    assert kept(SnapKV(budget=w, window=w), rows, w) == [[window(N, w)]]


def test_avg_pool_counts_the_zero_padding_like_the_reference():
    N, w = 20, 4
    rows = planted_view(1, 1, 1, w, N, {(0, 0, 0): 0.6, (0, 0, 5): 0.5, (0, 0, 6): 0.4})
    policy = SnapKV(budget=w + 2, window=w, kernel_size=3, pooling="avgpool")
    # count_include_pad=True: row 0 scores 0.6/3 = 0.2 < rows 5, 6 = 0.9/3; excluding the pad would give 0.3
    assert kept(policy, rows, w + 2) == [[[5, 6, *window(N, w)]]]
    votes = torch.zeros(1, 1, N - w)
    votes[0, 0, [0, 5, 6]] = torch.tensor([0.6, 0.5, 0.4])
    reference = F.avg_pool1d(votes, kernel_size=3, padding=1, stride=1)[0, 0]
    assert torch.allclose(policy.scores(rows)[0, 0, : N - w], reference)


@pytest.mark.parametrize(
    ("aggregate", "expected"),
    [("mean", [[4], [8]]), ("sum", [[4], [8]]), ("max", [[3], [7]])],
)
def test_gqa_aggregation_over_the_query_heads_of_each_kv_head(aggregate, expected):
    N, w = 20, 4
    plants = {
        (0, 0, 3): 0.6, (0, 0, 4): 0.5, (0, 1, 4): 0.5,  # KV head 0 = query heads 0, 1
        (0, 2, 7): 0.7, (0, 2, 8): 0.4, (0, 3, 8): 0.4,  # KV head 1 = query heads 2, 3
    }
    rows = planted_view(1, 4, 2, w, N, plants)
    got = kept(SnapKV(budget=w + 1, window=w, kernel_size=1, aggregate=aggregate), rows, w + 1)
    # grouping heads as (0, 2), (1, 3) instead of (0, 1), (2, 3) would make KV head 0 keep row 7
    assert got == [[[*expected[0], *window(N, w)], [*expected[1], *window(N, w)]]]


def test_left_padding_is_never_kept_and_each_batch_element_chooses():
    N, w = 24, 4
    valid = torch.ones(2, 1, N, dtype=torch.bool)
    valid[1, :, :5] = False  # element 1: five padding rows first
    plants = {(0, 0, 14): 1.0, (1, 0, 5): 1.0}
    rows = planted_view(2, 1, 1, w, N, plants, valid=valid)
    got = kept(SnapKV(budget=w + 4, window=w), rows, w + 4)
    assert got[0] == [[11, 12, 13, 14, *window(N, w)]]
    # the pooled plateau covers padding rows 2..4 too; they rank below every valid row
    assert got[1] == [[5, 6, 7, 8, *window(N, w)]]
    # fewer valid rows than `keep`: every valid row stays, padding fills the rest
    valid = torch.zeros(1, 1, N, dtype=torch.bool)
    valid[..., -6:] = True
    rows = planted_view(1, 1, 1, w, N, {}, valid=valid)
    got = kept(SnapKV(budget=10, window=w), rows, 10)
    assert set(range(N - 6, N)) <= set(got[0][0])


def planted_keys_view(N: int, w: int, planted: dict[int, list[int]]) -> RowsView:
    """Keys and queries by hand: KV head g's query heads look along axis g; ``planted[g]`` rows carry big keys there.

    The window attention comes from kvzoo's own kernel (the runtime's path), not from a planted tensor.
    """
    B, G, H, D = 1, 2, 4, 8
    g = torch.Generator().manual_seed(5)
    keys = 0.05 * torch.randn(B, G, N, D, generator=g)
    queries = torch.zeros(B, H, w, D)
    for kv_head, rows in planted.items():
        keys[0, kv_head, rows, kv_head] = 6.0
        queries[0, 2 * kv_head : 2 * kv_head + 2, :, kv_head] = 4.0
    slots = torch.arange(N).expand(B, G, N)
    valid = torch.ones(B, G, N, dtype=torch.bool)
    attn = window_attention_kernel(queries, torch.arange(N - w, N), keys, slots, valid, D**-0.5)
    return RowsView(keys=keys, values=keys.clone(), slots=slots, valid=valid, layer_idx=0, num_layers=1,
                    window_attention=attn)


def test_planted_keys_through_the_attention_kernel():
    N, w = 48, 8
    rows = planted_keys_view(N, w, {0: [5, 17], 1: [9, 22]})
    assert kept(SnapKV(budget=w + 2, window=w, kernel_size=1), rows, w + 2) == [
        [[5, 17, *window(N, w)], [9, 22, *window(N, w)]]
    ]
    # kernel 7, max pooling: each planted key keeps itself and three rows on each side
    assert kept(SnapKV(budget=w + 14, window=w), rows, w + 14) == [
        [[*range(2, 9), *range(14, 21), *window(N, w)], [*range(6, 13), *range(19, 26), *window(N, w)]]
    ]


# --- through the model -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def eager_tiny():
    model, _ = tiny_llama(seed=0)
    model.set_attn_implementation("eager")
    return model


def test_matches_the_reference_algorithm_on_eager_attention(tiny, eager_tiny):
    """Scores from transformers' eager attention, pooled as the reference does; the kept rows must be its top-k."""
    T, budget = 160, 48
    policy = SnapKV(budget=budget)
    ids = torch.randint(1, 256, (1, T), generator=torch.Generator().manual_seed(11))
    cache = TieredCache(tiny, policy)
    assert tiny.config._attn_implementation == "kvzoo"  # observed attention without eager mode
    tiny(input_ids=ids, cache=cache, use_cache=True)
    cache.compress()
    attentions = eager_tiny(input_ids=ids, output_attentions=True).attentions
    w, k = policy.window, policy.kernel_size
    for layer, attn in zip(cache.layers, attentions):
        # the reference's update_kv, on eager probabilities [B, H, T, T]
        votes = attn[:, :, -w:, :-w].sum(dim=-2)
        pooled = F.max_pool1d(votes, kernel_size=k, padding=k // 2, stride=1)
        scores = pooled.view(1, 2, 2, T - w).mean(dim=2)  # mean over each KV head's 2 query heads
        for g in range(2):
            slots = layer.slots[0, g]
            assert slots.shape[0] == budget
            assert torch.equal(slots[-w:], torch.arange(T - w, T))
            chosen = slots[:-w]
            evicted = torch.ones(T - w, dtype=torch.bool)
            evicted[chosen] = False
            # top-k up to float noise between the two attention implementations
            assert scores[0, g, chosen].min() >= scores[0, g, evicted].max() - 1e-6


@pytest.mark.parametrize(("archive", "chunk_size"), [(True, None), (False, None), (True, 64)])
def test_ratio_budget_is_exact_and_archive_or_drop(tiny, archive, chunk_size):
    T = 203
    ids = torch.randint(1, 256, (1, T), generator=torch.Generator().manual_seed(12))
    q = torch.randint(1, 256, (1, 7), generator=torch.Generator().manual_seed(13))
    result = generate(tiny, None, ids, q, registry.get("snapkv", ratio=4, archive=archive),
                      chunk_size=chunk_size, max_new_tokens=5)
    budget = T // 4
    for s in result.stats.layers:
        assert s.seen_rows == T + 7 + 4
        assert s.resident_rows == budget + 7 + 4  # only the context is compressed
        assert s.events == 1
        evicted = s.archived_rows if archive else s.dropped_rows
        assert evicted == T - budget
        assert (s.dropped_rows if archive else s.archived_rows) == 0


def test_budget_larger_than_the_context_is_a_no_op(tiny):
    ids = torch.randint(1, 256, (1, 60), generator=torch.Generator().manual_seed(14))
    result = generate(tiny, None, ids, [5, 6], SnapKV(budget=100), max_new_tokens=3)
    totals = result.stats.totals
    assert totals["events"] == totals["archived_rows"] == totals["dropped_rows"] == 0
    assert totals["resident_rows"] == totals["seen_rows"]


def test_invalid_parameters_raise_clear_errors(tiny):
    with pytest.raises(ValueError, match=r"window \(32\) is larger than budget \(16\)"):
        SnapKV(budget=16)
    with pytest.raises(ValueError, match="kernel_size must be an odd int >= 1"):
        SnapKV(ratio=4, kernel_size=4)
    with pytest.raises(ValueError, match="kernel_size must be an odd int >= 1"):
        SnapKV(ratio=4, kernel_size=0)
    with pytest.raises(ValueError, match=r"pooling must be one of \('maxpool', 'avgpool'\)"):
        SnapKV(ratio=4, pooling="max")
    with pytest.raises(ValueError, match="aggregate must be one of"):
        registry.get("snapkv", ratio=4, aggregate="median")
    with pytest.raises(ValueError, match="window must be an int >= 1"):
        SnapKV(ratio=4, window=0)
    # a ratio budget smaller than the window is known only at the event: 100 rows / 4 = 25 < 32
    cache = TieredCache(tiny, SnapKV(ratio=4))
    tiny(input_ids=torch.randint(1, 256, (1, 100), generator=torch.Generator().manual_seed(15)), cache=cache,
         use_cache=True)
    with pytest.raises(ValueError, match=r"may keep 25 rows, fewer than the observation window of 32 rows"):
        cache.compress()
