"""H2O: heavy hitters + recent window on planted scores; 200 decode steps checked against a brute force."""

from __future__ import annotations

import pytest
import torch

import kvzoo.framework.attention as attention
from kvzoo import TieredCache, registry
from kvzoo.framework.policy import RowsView
from kvzoo.framework.runtime import Runtime
from kvzoo.kernels.attention import attention_reference
from kvzoo.pipeline import generate
from kvzoo.policies.h2o import H2O


def scored_view(scores: torch.Tensor, valid: torch.Tensor | None = None) -> RowsView:
    """A RowsView of ``scores [B, G, N]`` accumulated attention."""
    B, G, N = scores.shape
    keys = torch.zeros(B, G, N, 4)
    if valid is None:
        valid = torch.ones(B, G, N, dtype=torch.bool)
    return RowsView(keys=keys, values=keys.clone(), slots=torch.arange(N).expand(B, G, N), valid=valid,
                    layer_idx=0, num_layers=1, row_stats={"attention": scores.float()})


# --- the selector on planted scores ------------------------------------------------------------


def test_heavy_hitters_come_from_outside_the_recent_window():
    N = 12
    scores = torch.full((1, 1, N), 0.1)
    scores[0, 0, [1, 4, 6]] = torch.tensor([3.0, 2.0, 1.0])
    scores[0, 0, 10] = 50.0  # a recent row with a high score must not take a heavy hitter's place
    scores[0, 0, 8] = 0.5  # just outside the recent window: the 4th heavy candidate, not kept
    got = H2O(budget=6).select(scored_view(scores), 6).tolist()
    assert got == [[[1, 4, 6, 9, 10, 11]]]  # heavy 3 (floor(6 * 0.5)) + recent 3
    # odd budget: heavy = floor(7 / 2) = 3, recent = 4
    assert H2O(budget=7).select(scored_view(scores), 7).tolist() == [[[1, 4, 6, 8, 9, 10, 11]]]
    assert H2O(budget=7).split(7) == (3, 4)


@pytest.mark.parametrize(
    ("heavy_fraction", "expected"),
    [(1.0, [1, 4, 6, 8, 10]), (0.0, [7, 8, 9, 10, 11]), (0.6, [1, 4, 6, 10, 11])],
)
def test_heavy_recent_split_is_a_parameter(heavy_fraction, expected):
    scores = torch.full((1, 1, 12), 0.1)
    scores[0, 0, [1, 4, 6, 8, 10]] = torch.tensor([3.0, 2.0, 1.0, 0.5, 50.0])
    policy = H2O(budget=5, heavy_fraction=heavy_fraction)
    assert policy.select(scored_view(scores), 5).tolist() == [[expected]]


def test_each_kv_head_and_batch_element_keeps_its_own_heavy_hitters_never_padding():
    scores = torch.zeros(2, 2, 10)
    for (b, grp), heavy_rows in {(0, 0): [2, 5], (0, 1): [1, 6], (1, 0): [4, 7], (1, 1): [3, 5]}.items():
        scores[b, grp, heavy_rows] = 1.0
    valid = torch.ones(2, 2, 10, dtype=torch.bool)
    valid[1, :, :2] = False  # element 1: two padding rows (a padding query attends to its own row)
    scores[1, :, :2] = 9.0
    got = H2O(budget=4).select(scored_view(scores, valid), 4).tolist()
    assert got == [[[2, 5, 8, 9], [1, 6, 8, 9]], [[4, 7, 8, 9], [3, 5, 8, 9]]]


def test_planted_keys_through_the_accumulating_attention_kernel():
    """A 30-query causal pass over keys planted along the queries' direction: the planted rows are the heavy hitters."""
    B, G, H, D, T = 1, 2, 4, 8, 30
    keys = 0.05 * torch.randn(B, G, T, D, generator=torch.Generator().manual_seed(7))
    keys[0, 0, [3, 11], 0] = 6.0  # KV head 0
    keys[0, 1, [7, 20], 1] = 6.0  # KV head 1
    queries = torch.zeros(B, H, T, D)
    queries[0, :2, :, 0] = queries[0, 2:, :, 1] = 4.0
    slots, valid = torch.arange(T).expand(B, G, T), torch.ones(B, G, T, dtype=torch.bool)
    _, sums = attention_reference(queries, keys, keys, slots, valid, torch.arange(T), D**-0.5, column_sums=True)
    got = H2O(budget=6).select(scored_view(sums), 6).tolist()
    # heavy 3: the two planted rows and row 0 (all of query 0's attention, half of query 1's, ...)
    assert got == [[[0, 3, 11, 27, 28, 29], [0, 7, 20, 27, 28, 29]]]


# --- 200 decode steps against a brute force ------------------------------------------------------


class AttentionLog:
    """Logs, per layer and forward, what the attention saw (in slot order) and the tier the step left behind.

    The prefill goes through the multi-token reference (``attention_reference``), a decode step through
    ``framework/attention.py``'s ``decode_step``: both are spied on."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.entries: list[dict] = []
        self._pending: dict | None = None
        real_attention = attention.attention_reference
        real_decode = attention.decode_step
        real_after_forward = Runtime.after_forward

        def attention_spy(query, keys, values, key_slots, key_valid, query_slots, scaling, **kwargs):
            self._pending = dict(query=query.detach().clone(), keys=keys.clone(), slots=key_slots.clone(),
                                 valid=key_valid.clone(), q_slots=query_slots.clone(), scaling=scaling)
            return real_attention(query, keys, values, key_slots, key_valid, query_slots, scaling, **kwargs)

        def decode_spy(layer, query, scaling):
            store = layer.store
            order = store.get("slots").argsort(dim=-1)  # the tier may be out of slot order after one in, one out
            keys = store.get("keys").gather(2, order[..., None].expand(*order.shape, store.get("keys").shape[-1]))
            self._pending = dict(query=query.detach().clone(), keys=keys, slots=store.get("slots").gather(2, order),
                                 valid=store.get("valid").gather(2, order),
                                 q_slots=torch.tensor([layer.counts.seen - 1]), scaling=scaling)
            return real_decode(layer, query, scaling)

        def after_forward(rt, layer):
            real_after_forward(rt, layer)
            entry, self._pending = self._pending, None
            layer.store.ensure_order()
            entry.update(layer=layer.layer_idx, kept_slots=layer.store.get("slots").clone(),
                         kept_scores=layer.store.row_statistics()["attention"].clone())
            self.entries.append(entry)

        monkeypatch.setattr(attention, "attention_reference", attention_spy)
        monkeypatch.setattr(attention, "decode_step", decode_spy)
        monkeypatch.setattr(Runtime, "after_forward", after_forward)


def brute_force_column_sums(entry: dict) -> torch.Tensor:
    """Attention each row received in one forward, ``[B, G, n]`` float64, from the logged queries and keys."""
    q, k = entry["query"].double(), entry["keys"].double()
    B, H, _, _ = q.shape
    G = k.shape[1]
    k = k.repeat_interleave(H // G, dim=1)  # query head h reads KV head h // (H // G)
    logits = torch.einsum("bhqd,bhnd->bhqn", q, k) * entry["scaling"]
    slots = entry["slots"].repeat_interleave(H // G, dim=1)[:, :, None, :]  # [B, H, 1, n]
    valid = entry["valid"].repeat_interleave(H // G, dim=1)[:, :, None, :]
    q_slots = entry["q_slots"][None, None, :, None]
    allowed = (valid & (slots <= q_slots)) | (slots == q_slots)
    probs = torch.softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1)
    return probs.sum(dim=2).view(B, G, H // G, -1).sum(dim=2)


def test_200_decode_steps_hold_the_budget_and_accumulators_match_brute_force(tiny, monkeypatch):
    log = AttentionLog(monkeypatch)
    B, T, steps, budget, pad = 2, 40, 200, 24, 6
    policy = H2O(budget=budget)
    heavy, recent = policy.split(budget)
    g = torch.Generator().manual_seed(21)
    ids = torch.randint(1, 256, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    ids[1, :pad], mask[1, :pad] = 0, 0  # left padding on element 1
    cache = TieredCache(tiny, policy)
    assert tiny.config._attn_implementation == "kvzoo"  # observed attention without eager mode
    tiny(input_ids=ids, attention_mask=mask, cache=cache, use_cache=True)
    assert [layer.store.n for layer in cache.layers] == [budget] * 3  # evicted right after the prefill
    for _ in range(steps):
        mask = torch.cat([mask, torch.ones(B, 1, dtype=torch.long)], dim=1)
        tiny(input_ids=torch.randint(1, 256, (B, 1), generator=g), attention_mask=mask, cache=cache, use_cache=True)
        assert [layer.store.n for layer in cache.layers] == [budget] * 3  # one in, one out, every step
    cache.compress()  # the context_end event finds the tier at budget: nothing moves
    assert len(log.entries) == 3 * (1 + steps)

    total = T + steps
    accumulated = {i: torch.zeros(B, 2, total, dtype=torch.float64) for i in range(3)}
    worst = 0.0
    for entry in log.entries:
        acc = accumulated[entry["layer"]]
        acc.scatter_add_(2, entry["slots"], brute_force_column_sums(entry))
        kept_slots = entry["kept_slots"]
        assert kept_slots.shape[2] == budget
        # the runtime's accumulators followed their rows through every eviction
        expected = acc.gather(2, kept_slots)
        error = (entry["kept_scores"].double() - expected).abs() / expected.abs().clamp(min=1.0)
        worst = max(worst, error.max().item())
        # and the rows kept are H2O's choice: the recent rows, then the heaviest of the others
        before = entry["slots"]
        for b in range(B):
            for grp in range(2):
                rows = before[b, grp][entry["valid"][b, grp]]  # padding is never kept (enough valid rows)
                keep = set(kept_slots[b, grp].tolist())
                assert keep <= set(rows.tolist())
                assert set(rows[-recent:].tolist()) <= keep
                candidates = rows[:-recent]
                chosen = torch.tensor([s in keep for s in candidates.tolist()])
                score = acc[b, grp, candidates]
                assert int(chosen.sum()) == heavy
                if (~chosen).any():
                    assert score[chosen].min() >= score[~chosen].max() - 1e-5
    assert worst < 1e-6, worst  # fp32 accumulation over up to 240 forwards vs float64
    assert cache.get_seq_length() == total
    stats = cache.stats().totals
    # eviction only (no retriever): every evicted row dropped and counted
    assert stats["events"] == 3 * (1 + steps) and stats["dropped_rows"] == 3 * (total - budget)
    assert stats["archived_rows"] == 0


# --- budgets, archive, errors -------------------------------------------------------------------


@pytest.mark.parametrize(("archive", "chunk_size"), [(True, None), (False, None), (True, 64)])
def test_ratio_budget_is_exact_through_the_pipeline(tiny, archive, chunk_size):
    T = 203
    ids = torch.randint(1, 256, (1, T), generator=torch.Generator().manual_seed(22))
    q = torch.randint(1, 256, (1, 7), generator=torch.Generator().manual_seed(23))
    result = generate(tiny, None, ids, q, registry.get("h2o", ratio=4, archive=archive),
                      chunk_size=chunk_size, max_new_tokens=6)
    for s in result.stats.layers:
        assert s.seen_rows == T + 7 + 5
        assert s.resident_rows == T // 4  # context, question and generated rows all held at the budget
        evicted = s.archived_rows if archive else s.dropped_rows
        assert evicted == s.seen_rows - T // 4
        assert (s.dropped_rows if archive else s.archived_rows) == 0


def test_budget_larger_than_the_sequence_is_a_no_op(tiny):
    ids = torch.randint(1, 256, (1, 60), generator=torch.Generator().manual_seed(24))
    result = generate(tiny, None, ids, [5, 6], H2O(budget=100), max_new_tokens=4)
    totals = result.stats.totals
    assert totals["events"] == totals["archived_rows"] == totals["dropped_rows"] == 0
    assert totals["resident_rows"] == totals["seen_rows"] == 3 * 65


@pytest.mark.parametrize("bad", [-0.1, 1.5, float("nan"), "half", True])
def test_invalid_heavy_fraction_raises(bad):
    with pytest.raises(ValueError, match=r"heavy_fraction must be a number in \[0, 1\]"):
        registry.get("h2o", budget=8, heavy_fraction=bad)


def test_needs_a_budget():
    with pytest.raises(ValueError, match="h2o needs a budget"):
        registry.get("h2o")
