"""ChunkKV: chunk boundaries, partial chunks, shared-by-heads and per-batch selection, layer-wise index reuse."""

from __future__ import annotations

import math

import pytest
import torch

from kvzoo import TieredCache, registry
from kvzoo.framework.policy import RowsView, top_rows
from kvzoo.kernels.attention import window_attention as window_attention_kernel
from kvzoo.models import tiny_llama
from kvzoo.pipeline import generate
from kvzoo.policies.chunkkv import ChunkKV


def planted_view(B: int, H: int, G: int, w: int, N: int, plants: dict, valid: torch.Tensor | None = None,
                 layer_idx: int = 0, layer_rank: int | None = None, shared: dict | None = None) -> RowsView:
    """A RowsView whose window attention, summed over the ``w`` window queries, is ``plants``.

    ``plants`` maps ``(batch, head, row) -> vote``; each window query gives ``vote / w`` to the row.
    """
    attn = torch.zeros(B, H, w, N)
    for (b, h, row), vote in plants.items():
        attn[b, h, :, row] += vote / w
    if valid is None:
        valid = torch.ones(B, G, N, dtype=torch.bool)
    keys = torch.zeros(B, G, N, 4)
    return RowsView(keys=keys, values=keys.clone(), slots=torch.arange(N).expand(B, G, N), valid=valid,
                    layer_idx=layer_idx, num_layers=4, layer_rank=layer_idx if layer_rank is None else layer_rank,
                    window_attention=attn,
                    shared={} if shared is None else shared)


def kept(policy: ChunkKV, rows: RowsView, keep: int) -> list:
    out = policy.select(rows, keep)
    assert out.shape == (*rows.slots.shape[:2], keep) and out.dtype == torch.long
    return out.tolist()


# --- the algorithm on hand-built caches ----------------------------------------------------------


def test_chunks_tile_the_rows_before_the_window_with_a_partial_last_chunk():
    # 17 rows, window 3: rows 0..13 form chunks [0-3] [4-7] [8-11] [12-13] (partial), window 14..16
    N, w, c = 17, 3, 4
    plants = {(0, 0, 12): 1.0, (0, 0, 13): 0.5, (0, 0, 5): 0.9, (0, 0, 0): 0.2, (0, 0, 9): 0.1}
    rows = planted_view(1, 2, 1, w, N, plants)
    policy = ChunkKV(budget=w + 6, window=w, chunk_size=c, reuse=1)
    # best: the partial chunk (1.5), then [4-7] (0.9)
    assert kept(policy, rows, w + 6) == [[[4, 5, 6, 7, 12, 13, 14, 15, 16]]]
    # keep - w = 5 rows: the partial chunk, then the leading 3 rows of the next chunk
    assert kept(policy, rows, w + 5) == [[[4, 5, 6, 12, 13, 14, 15, 16]]]
    # keep - w = 7: then the first row of [0-3] (0.2 beats [8-11] at 0.1)
    assert kept(policy, rows, w + 7) == [[[0, 4, 5, 6, 7, 12, 13, 14, 15, 16]]]
    # the budget is the window exactly: only the window stays
    assert kept(policy, rows, w) == [[[14, 15, 16]]]


def test_chunk_score_is_the_sum_not_the_mean():
    N, w, c = 17, 3, 4
    plants = {(0, 0, 12): 0.5, (0, 0, 13): 0.3}  # partial chunk: sum 0.8, mean 0.4
    plants.update({(0, 0, r): 0.25 for r in range(4, 8)})  # chunk [4-7]: sum 1.0, mean 0.25
    rows = planted_view(1, 1, 1, w, N, plants)
    got = kept(ChunkKV(budget=w + 4, window=w, chunk_size=c, reuse=1), rows, w + 4)
    assert got == [[[4, 5, 6, 7, 14, 15, 16]]]


def test_window_rows_are_kept_and_never_scored_as_part_of_a_chunk():
    # 15 rows, window 4: chunks [0-3] [4-7] [8-10]; window 11..14. Chunking all rows from 0 would
    # put window row 11 in chunk [8-11] and its vote would win.
    N, w, c = 15, 4, 4
    rows = planted_view(1, 1, 1, w, N, {(0, 0, 11): 5.0, (0, 0, 1): 0.3, (0, 0, 6): 0.2})
    got = kept(ChunkKV(budget=w + 4, window=w, chunk_size=c, reuse=1), rows, w + 4)
    assert got == [[[0, 1, 2, 3, 11, 12, 13, 14]]]


def test_selection_is_shared_by_all_heads_of_the_layer():
    N, w, c = 23, 3, 5
    # query head 0 alone prefers chunk [0-4]; heads 1-3 together prefer chunk [10-14]
    plants = {(0, 0, 1): 1.0, (0, 1, 12): 0.4, (0, 2, 12): 0.4, (0, 3, 12): 0.4}
    rows = planted_view(1, 4, 2, w, N, plants)
    got = kept(ChunkKV(budget=w + 5, window=w, chunk_size=c, reuse=1), rows, w + 5)
    expected = [10, 11, 12, 13, 14, 20, 21, 22]
    assert got == [[expected, expected]]  # per-KV-head selection would give KV head 0 chunk [0-4]


def test_each_batch_element_chooses_and_chunks_start_at_its_first_token():
    N, w, c = 23, 3, 4
    valid = torch.ones(2, 2, N, dtype=torch.bool)
    valid[1, :, :3] = False  # element 1: three padding rows; its chunks are [3-6] [7-10] [11-14] ...
    plants = {(0, 0, 2): 1.0, (1, 0, 7): 1.0, (1, 1, 1): 9.0}  # padding row 1 of element 1 is never kept
    rows = planted_view(2, 2, 2, w, N, plants, valid=valid)
    got = kept(ChunkKV(budget=w + 4, window=w, chunk_size=c, reuse=1), rows, w + 4)
    window = [20, 21, 22]
    assert got[0] == [[0, 1, 2, 3, *window]] * 2
    # aligned to row 0 instead, element 1 would keep [4-7]
    assert got[1] == [[7, 8, 9, 10, *window]] * 2


def test_reusing_layer_copies_the_slots_of_its_group_leader():
    N, w, c = 23, 3, 4
    shared: dict = {}
    policy = ChunkKV(budget=w + 4, window=w, chunk_size=c, reuse=2)
    leader = planted_view(1, 2, 2, w, N, {(0, 0, 9): 1.0}, layer_idx=2, shared=shared)
    assert kept(policy, leader, w + 4) == [[[8, 9, 10, 11, 20, 21, 22]] * 2]
    assert leader.info == {"chunkkv_scored": 1, "chunkkv_reused": 0}
    # layer 3 sees other attention but reuses layer 2's slots (mapped to its own row indices)
    follower = planted_view(1, 2, 2, w, N, {(0, 0, 0): 5.0}, layer_idx=3, shared=shared)
    assert kept(policy, follower, w + 4) == [[[8, 9, 10, 11, 20, 21, 22]] * 2]
    assert follower.info == {"chunkkv_scored": 0, "chunkkv_reused": 1}
    # a follower whose tier lacks a kept slot cannot reuse: a clear error, not a silent wrong row
    missing = planted_view(1, 2, 2, w, N, {}, layer_idx=3, shared=shared)
    missing.slots = torch.cat([torch.arange(9), torch.arange(10, N + 1)]).expand(1, 2, N)
    with pytest.raises(RuntimeError, match="reuses the indices of layer 2"):
        policy.select(missing, w + 4)
    # the leader scored nothing at this event
    with pytest.raises(RuntimeError, match="layer 1 reuses the indices of layer #0.*scored no rows"):
        policy.select(planted_view(1, 2, 2, w, N, {}, layer_idx=1), w + 4)


@pytest.mark.parametrize(("tiling", "kernel_size"), [("paper", 1), ("kvpress", 3)])
def test_priority_is_the_selector_as_a_score(tiling, kernel_size):
    """priority() (what ChunkKV's kvpress ScorerPress scores): for every keep, its top rows (ties to the earlier row)
    are select()'s -- the best chunks whole, the last one cut -- in a left-padded batch, and a reusing layer scores
    as its group leader scored the same slots; a layer whose leader scored no such slots is refused."""
    B, H, G, w, N = 2, 4, 2, 3, 41
    generator = torch.Generator().manual_seed(0)
    attention = torch.rand(B, H, w, N, generator=generator).softmax(dim=-1)
    valid = torch.ones(B, G, N, dtype=torch.bool)
    valid[1, :, :5] = False  # the second sequence is left-padded

    def view(layer_idx: int, shared: dict) -> RowsView:
        keys = torch.zeros(B, G, N, 4)
        return RowsView(keys=keys, values=keys.clone(), slots=torch.arange(N).expand(B, G, N), valid=valid,
                        layer_idx=layer_idx, num_layers=2, layer_rank=layer_idx, window_attention=attention,
                        shared=shared)

    policy = ChunkKV(budget=w, window=w, chunk_size=4, reuse=2, kernel_size=kernel_size, tiling=tiling)
    for keep in range(w, N):
        scored, selected = {}, {}
        for layer in (0, 1):  # the leader, then the layer that reuses its indices
            by_score = top_rows(policy.priority(view(layer, scored), keep), keep)
            assert torch.equal(by_score, policy.select(view(layer, selected), keep)), (keep, layer)
    with pytest.raises(RuntimeError, match="layer 1 reuses the indices of layer #0"):
        policy.priority(view(1, {}), w)


def test_reuse_groups_count_attention_layers_only():
    """A hybrid model (Kimi Linear) holds rows in layers 1, 3, 5, 7 only (ranks 0-3): groups are (1, 3) and (5, 7)."""
    N, w, c = 23, 3, 4
    shared: dict = {}
    policy = ChunkKV(budget=w + 4, window=w, chunk_size=c, reuse=2)
    chosen = {}
    for rank, (layer_idx, row) in enumerate(((1, 2), (3, 14), (5, 9), (7, 0))):
        view = planted_view(1, 1, 1, w, N, {(0, 0, row): 1.0}, layer_idx=layer_idx, layer_rank=rank, shared=shared)
        chosen[layer_idx] = kept(policy, view, w + 4)[0][0][:4]
        assert view.info["chunkkv_reused"] == (layer_idx in (3, 7))
    assert chosen == {1: [0, 1, 2, 3], 3: [0, 1, 2, 3], 5: [8, 9, 10, 11], 7: [8, 9, 10, 11]}


def test_planted_keys_through_the_attention_kernel():
    """Keys planted along the window queries' direction (both KV heads) make their chunks win."""
    B, G, H, D, N, w = 1, 2, 4, 8, 48, 8
    keys = 0.05 * torch.randn(B, G, N, D, generator=torch.Generator().manual_seed(6))
    keys[0, 0, 13, 0] = keys[0, 1, 27, 1] = 6.0  # KV head 0 plants row 13, KV head 1 row 27
    queries = torch.zeros(B, H, w, D)
    queries[0, :2, :, 0] = queries[0, 2:, :, 1] = 4.0
    slots, valid = torch.arange(N).expand(B, G, N), torch.ones(B, G, N, dtype=torch.bool)
    attn = window_attention_kernel(queries, torch.arange(N - w, N), keys, slots, valid, D**-0.5)
    rows = RowsView(keys=keys, values=keys.clone(), slots=slots, valid=valid, layer_idx=0, num_layers=1,
                    window_attention=attn)
    # chunks of 10 over rows 0..39: row 13 -> [10-19], row 27 -> [20-29]; both KV heads keep both
    expected = [*range(10, 30), *range(N - w, N)]
    assert kept(ChunkKV(budget=w + 20, window=w, reuse=1), rows, w + 20) == [[expected, expected]]


# --- through the model -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny4():
    """A 4-layer tiny Llama (2 reuse groups of 2 at reuse=2)."""
    model, _ = tiny_llama(seed=1, num_hidden_layers=4)
    return model


def run_context(model, policy, T=200, seed=31):
    ids = torch.randint(1, 256, (1, T), generator=torch.Generator().manual_seed(seed))
    cache = TieredCache(model, policy)
    model(input_ids=ids, cache=cache, use_cache=True)
    cache.compress()
    return cache, ids


@pytest.mark.parametrize(("layers", "reuse", "scorers"), [(4, 2, [0, 2]), (3, 2, [0, 2]), (4, 1, [0, 1, 2, 3]),
                                                          (4, 3, [0, 3]), (3, 3, [0])])
def test_reuse_calls_the_scorer_on_ceil_layers_over_reuse(tiny, tiny4, monkeypatch, layers, reuse, scorers):
    calls = []
    real = ChunkKV.row_scores

    def counting(self, rows):
        calls.append(rows.layer_idx)
        return real(self, rows)

    monkeypatch.setattr(ChunkKV, "row_scores", counting)
    model = tiny4 if layers == 4 else tiny
    cache, _ = run_context(model, ChunkKV(ratio=4, reuse=reuse))
    assert calls == scorers and len(scorers) == math.ceil(layers / reuse)
    totals = cache.stats().totals
    assert totals["chunkkv_scored"] == len(scorers) and totals["chunkkv_reused"] == layers - len(scorers)
    for layer in cache.layers:
        assert layer.store.n == 50
        leader = cache.layers[layer.layer_idx - layer.layer_idx % reuse]
        assert torch.equal(layer.slots, leader.slots)  # the same positions as the group's first layer


@pytest.mark.parametrize(("layers", "reuse", "computed"), [(4, 2, [0, 2]), (3, 2, [0, 2]), (4, 1, [0, 1, 2, 3]),
                                                            (4, 3, [0, 3]), (3, 3, [0])])
def test_a_reusing_layer_computes_no_window_attention(tiny, tiny4, monkeypatch, layers, reuse, computed):
    """The window attention (what the runtime computes when a selector asks) runs on the scoring layers only: a
    reusing layer's checks read lengths. Counted at the one function that computes it."""
    import kvzoo.framework.policy as policy_layer  # the one RowsView builder, observed_rows, computes it there

    calls = []
    real = policy_layer.window_attention

    def counting(queries, q_slots, keys, slots, valid, scaling):
        calls.append(keys.shape[2])
        return real(queries, q_slots, keys, slots, valid, scaling)

    monkeypatch.setattr(policy_layer, "window_attention", counting)
    model = tiny4 if layers == 4 else tiny
    cache, _ = run_context(model, ChunkKV(ratio=4, reuse=reuse))
    assert len(calls) == len(computed) == math.ceil(layers / reuse)
    assert cache.stats().totals["chunkkv_reused"] == layers - len(computed)


def test_the_window_check_reads_lengths_only():
    """check_window_fits on a view that only knows w (window_queries): no attention computed, the error still
    raised when the window does not fit."""
    computed = []

    def window_fn():
        computed.append(1)
        return torch.zeros(1, 2, 8, 20)

    keys = torch.zeros(1, 1, 20, 4)
    rows = RowsView(keys=keys, values=keys.clone(), slots=torch.arange(20).expand(1, 1, 20),
                    valid=torch.ones(1, 1, 20, dtype=torch.bool), layer_idx=1, num_layers=2, layer_rank=1,
                    window_fn=window_fn, window_queries=8)
    from kvzoo.framework.policy import check_window_fits

    check_window_fits("chunkkv", rows, 8)
    with pytest.raises(ValueError, match="may keep 7 rows, fewer than the observation window of 8 rows"):
        check_window_fits("chunkkv", rows, 7)
    assert computed == []
    assert rows.window_size() == 8


def test_without_reuse_layers_choose_differently(tiny4):
    """So the reuse test above is not vacuous: on this model the layers' own choices differ."""
    cache, _ = run_context(tiny4, ChunkKV(ratio=4, reuse=1))
    assert not torch.equal(cache.layers[0].slots, cache.layers[1].slots)
    assert not torch.equal(cache.layers[2].slots, cache.layers[3].slots)


def test_kept_chunks_are_the_best_by_eager_attention(tiny4):
    """Chunk scores from transformers' eager attention (sum over window queries and heads); the kept chunks lead."""
    T, policy = 200, ChunkKV(ratio=4, reuse=1)
    cache, ids = run_context(tiny4, policy, T=T)
    eager, _ = tiny_llama(seed=1, num_hidden_layers=4)
    eager.set_attn_implementation("eager")
    attentions = eager(input_ids=ids, output_attentions=True).attentions
    w, c, keep = policy.window, policy.chunk_size, T // 4
    for layer, attn in zip(cache.layers, attentions):
        slots = layer.slots[0]
        assert torch.equal(slots[0], slots[1])  # one selection for both KV heads
        assert torch.equal(slots[0, -w:], torch.arange(T - w, T))
        row_scores = attn[0, :, -w:, : T - w].sum(dim=(0, 1))
        chunk_scores = torch.stack([row_scores[s : s + c].sum() for s in range(0, T - w, c)])
        taken = torch.zeros(len(chunk_scores))
        for s in slots[0, :-w].tolist():
            taken[s // c] += 1
        full = taken == torch.tensor([min(c, T - w - s) for s in range(0, T - w, c)])
        partial = (taken > 0) & ~full
        assert int(partial.sum()) <= 1 and int(taken.sum()) == keep - w
        # every fully kept chunk scores at least as high as every chunk left out (up to float noise)
        assert chunk_scores[full].min() >= chunk_scores[taken == 0].max() - 1e-5
        if partial.any():
            assert chunk_scores[full].min() >= chunk_scores[partial].max() - 1e-5
            assert chunk_scores[partial].max() >= chunk_scores[taken == 0].max() - 1e-5


@pytest.mark.parametrize(("archive", "chunk_size"), [(True, None), (False, None), (True, 64)])
def test_ratio_budget_is_exact_and_archive_or_drop(tiny, archive, chunk_size):
    T = 203
    ids = torch.randint(1, 256, (1, T), generator=torch.Generator().manual_seed(32))
    q = torch.randint(1, 256, (1, 7), generator=torch.Generator().manual_seed(33))
    result = generate(tiny, None, ids, q, registry.get("chunkkv", ratio=4, archive=archive),
                      chunk_size=chunk_size, max_new_tokens=5)
    budget = T // 4
    for s in result.stats.layers:
        assert s.seen_rows == T + 7 + 4
        assert s.resident_rows == budget + 7 + 4  # only the context is compressed
        evicted = s.archived_rows if archive else s.dropped_rows
        assert evicted == T - budget
        assert (s.dropped_rows if archive else s.archived_rows) == 0
    assert result.stats.totals["chunkkv_reused"] == 1  # 3 layers at reuse=2: layer 1 reuses layer 0


def test_absolute_budget_and_budget_larger_than_the_context(tiny):
    ids = torch.randint(1, 256, (1, 120), generator=torch.Generator().manual_seed(34))
    result = generate(tiny, None, ids, [5, 6], ChunkKV(budget=57), max_new_tokens=3)
    assert [s.resident_rows for s in result.stats.layers] == [57 + 2 + 2] * 3
    result = generate(tiny, None, ids, [5, 6], ChunkKV(budget=500), max_new_tokens=3)
    totals = result.stats.totals
    assert totals["events"] == totals["archived_rows"] == totals["dropped_rows"] == 0
    assert totals["resident_rows"] == totals["seen_rows"]


def test_invalid_parameters_raise_clear_errors(tiny):
    with pytest.raises(ValueError, match=r"window \(32\) is larger than budget \(20\)"):
        ChunkKV(budget=20)
    with pytest.raises(ValueError, match="chunk_size must be an int >= 1"):
        registry.get("chunkkv", ratio=4, chunk_size=0)
    with pytest.raises(ValueError, match="reuse must be an int >= 1"):
        registry.get("chunkkv", ratio=4, reuse=0)
    with pytest.raises(ValueError, match="window must be an int >= 1"):
        ChunkKV(ratio=4, window=0)
    cache = TieredCache(tiny, ChunkKV(ratio=8))
    tiny(input_ids=torch.randint(1, 256, (1, 100), generator=torch.Generator().manual_seed(35)), cache=cache,
         use_cache=True)
    with pytest.raises(ValueError, match=r"may keep 12 rows, fewer than the observation window of 32 rows"):
        cache.compress()
