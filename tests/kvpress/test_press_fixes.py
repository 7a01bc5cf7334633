"""kvzoo presses where kvpress's own tests take them (issue 24): short inputs, DecodingPress/CAMPress, Quest's
compression_ratio, ChunkKV and Quest as ScorerPress. kvpress's suite itself runs them too (``make test-kvpress``,
``tests/kvpress/upstream``); these pin each fix on its own, on the tiny random Llama (3 layers, 4 heads over 2).
"""

from __future__ import annotations

import warnings

import kvpress
import pytest
import torch
from kvpress.utils import get_prerope_query_states
from transformers import DynamicCache

from kvzoo import registry
from kvzoo.integrations.kvpress import to_press
from kvzoo.integrations.kvpress_presses import KvzooPress, KvzooScorerPress

from .conftest import rows_of

# every press to_press accepts, as make test-kvpress runs them: (registry params, to_press options)
PRESSES = {
    "streaming_llm": ({}, {"prefill_only": True}),
    "h2o": ({}, {"prefill_only": True}),
    "snapkv": ({}, {}),
    "chunkkv": ({}, {}),
    "vestige": ({"retriever": None}, {}),
    "quest": ({"retriever": None, "dense_layers": 0}, {"prefill_only": True}),
}


def press_of(name: str, ratio: float, **overrides):
    params, options = PRESSES[name]
    return to_press(registry.get(name, ratio=ratio, **{**params, **overrides}), **options)


def _ids(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", ["snapkv", "chunkkv"])
@pytest.mark.parametrize(("n", "ratio"), [(128, 5), (23, 1 / 0.6)])  # the cases: 25 of 128, 13 of 23 rows
def test_short_inputs_shrink_the_window_to_what_fits_and_say_so_once(name, n, ratio, tiny, kv):
    policy = registry.get(name, ratio=ratio)
    keep = policy.resolve_budget(n)
    assert keep < policy.window
    with pytest.raises(ValueError, match="fewer than the observation window"):  # kvzoo's runtime stays strict
        kv.zoo_rows(tiny, _ids(n), policy)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        kept = kv.press_rows(tiny, _ids(n), to_press(policy))
    window_said = [str(w.message) for w in said if "observation window of" in str(w.message)]
    assert len(window_said) == 1, window_said  # once for the press, not once per layer
    assert f"window of {keep} queries instead of window=32 (it may keep {keep} rows" in window_said[0]
    # the window is the rows that may stay, and it is always kept: every layer and head keeps the latest rows
    G = tiny.config.num_key_value_heads
    assert [layer.tolist() for layer in kept] == [[[list(range(n - keep, n))] * G]] * tiny.config.num_hidden_layers


def test_the_kvpress_twin_runs_where_the_kvzoo_press_runs(tiny, kv):
    """SnapKVPress at 25 of 128 rows (window 64 > 25 kept) runs; so does to_press(snapkv), 25 rows per layer."""
    ids = _ids(128)
    theirs = kv.press_rows(tiny, ids, kvpress.SnapKVPress(compression_ratio=0.8))
    ours = kv.press_rows(tiny, ids, press_of("snapkv", 5))
    assert [t.shape for t in theirs] == [o.shape for o in ours] == [(1, 2, 25)] * 3


@pytest.mark.parametrize("wrapper", ["DecodingPress", "CAMPress"])
@pytest.mark.parametrize("name", ["snapkv", "h2o", "chunkkv"])
def test_decoding_presses_run_window_and_accumulating_selectors(wrapper, name, tiny):
    """DecodingPress and CAMPress hand the press a buffer of the latest hidden states and the current token's RoPE
    (not the key count: the crash of issue 24). The press scores with the queries it can rotate -- the current
    token's -- keeps that token's row (SnapKV/ChunkKV: the window; H2O: its recent rows) and the cache is held at
    kvpress's target."""
    base = press_of(name, 4)
    press = getattr(kvpress, wrapper)(base_press=base, compression_interval=4, target_size=48)
    checked = []
    if wrapper == "DecodingPress":  # it calls base.compress: the kept rows, read from that call's keys
        compress = base.compress

        def recording(module, hidden_states, keys, values, attentions, kwargs):
            out_keys, out_values = compress(module, hidden_states, keys, values, attentions, kwargs)
            if out_keys.shape[2] < keys.shape[2]:
                checked.append(bool((rows_of(out_keys, keys)[..., -1] == keys.shape[2] - 1).all()))
            return out_keys, out_values

        base.compress = recording
    else:  # CAMPress calls base.score and takes its own top-k of the head-averaged score
        score = base.score

        def recording(module, hidden_states, keys, values, attentions, kwargs):
            scores = score(module, hidden_states, keys, values, attentions, kwargs)
            checked.append(bool((scores[..., -1] == scores.amax(dim=-1)).all()))
            return scores

        base.score = recording
    cache = DynamicCache()
    with warnings.catch_warnings(), torch.no_grad(), press(tiny):
        warnings.simplefilter("ignore")
        tiny.generate(_ids(40), max_new_tokens=24, min_new_tokens=24, do_sample=False, past_key_values=cache)
    assert checked and all(checked), checked
    assert all(48 <= layer.keys.shape[2] <= 48 + 4 - 1 for layer in cache.layers)


def _last_query(module, hidden_states, kwargs) -> torch.Tensor:
    """The last token's rotated query ``[B, H, dh]``, restated from kvpress's helper and the forward's RoPE."""
    query = get_prerope_query_states(module, hidden_states[:, -1:])[:, :, 0]  # [B, H, dh]
    cos, sin = (t[:, -1][:, None] for t in kwargs["position_embeddings"])  # [B, 1, dh]
    half = query.shape[-1] // 2
    return query * cos + torch.cat((-query[..., half:], query[..., :half]), dim=-1) * sin


@pytest.mark.parametrize(("press_kwargs", "kept_rows"), [({}, 80), ({"compression_ratio": 0.4}, 240)])
def test_quest_press_honours_compression_ratio_with_the_pages_quest_ranks_first(press_kwargs, kept_rows, tiny,
                                                                               tiny_ids):
    """Quest (retriever=None) as a press keeps the budget -- kvzoo's count at its ratio (400 / 5), kvpress's at a
    compression_ratio (int(400 * 0.6)) -- not only the current page: the current page (rows 384..399) and the
    archived pages with the highest Quest bound sum_i max(q_i min_i, q_i max_i) for the context's last query
    (max over a KV head's query heads), here restated in plain torch. Near-equal bounds (1e-4) may go either way."""
    policy = registry.get("quest", ratio=5, retriever=None, dense_layers=0)
    press = to_press(policy, prefill_only=True, **press_kwargs)
    assert isinstance(press, kvpress.ScorerPress)
    seen = []
    compress = press.compress

    def recording(module, hidden_states, keys, values, attentions, kwargs):
        out_keys, out_values = compress(module, hidden_states, keys, values, attentions, kwargs)
        seen.append((rows_of(out_keys, keys), keys, _last_query(module, hidden_states, kwargs), module.scaling))
        return out_keys, out_values

    press.compress = recording
    with torch.no_grad(), press(tiny):
        tiny.model(input_ids=tiny_ids, past_key_values=DynamicCache())
    assert len(seen) == tiny.config.num_hidden_layers
    size, n = policy.page_size, tiny_ids.shape[1]
    for kept, keys, query, scaling in seen:
        B, G, _, D = keys.shape
        assert kept.shape == (1, G, kept_rows)
        pages = keys[:, :, : n - size].reshape(B, G, -1, size, D)  # 24 archived pages; the current page is the last 16
        lo, hi = pages.amin(3), pages.amax(3)  # [B, G, p, D]
        q = query.view(B, G, -1, 1, D)  # [B, G, heads of the group, 1, D]
        bound = (torch.maximum(q * lo[:, :, None], q * hi[:, :, None]).sum(-1) * scaling).amax(2)  # [B, G, p]
        for g in range(G):
            rows = set(kept[0, g].tolist())
            assert set(range(n - size, n)) <= rows, "the current page is always kept"
            chosen = sorted({r // size for r in rows if r < n - size})
            whole = [p for p in chosen if all(p * size + i in rows for i in range(size))]
            assert len(whole) >= len(chosen) - 1, "pages are kept whole (the last one taken may be cut)"
            dropped = [p for p in range(pages.shape[2]) if p not in chosen]
            assert bound[0, g, chosen].min() >= bound[0, g, dropped].max() - 1e-4


def test_quest_press_keeps_more_than_the_runtime_attends(tiny, tiny_ids, kv):
    """kvzoo's runtime attends to Quest's sinks (``rule="eval"``: none by default, every other row competes from the
    index) or to its current page (``rule="kernel"``) and fetches pages every decode step; the press, which cannot
    fetch, keeps the budget at the context's end under either rule."""
    ids = tiny_ids[:, :390]  # 24 whole pages of 16 and a current page of 6 rows (a whole page leaves at once)
    for rule, attended in (("eval", 0), ("kernel", 6)):
        policy = registry.get("quest", ratio=5, retriever=None, dense_layers=0, rule=rule)
        assert [r.shape[2] for r in kv.zoo_rows(tiny, ids, policy)] == [attended] * 3, rule
        assert [r.shape[2] for r in kv.press_rows(tiny, ids, to_press(policy, prefill_only=True))] == [78] * 3


@pytest.mark.parametrize(("name", "overrides", "ratio"), [("chunkkv", {"window": 20}, 4), ("quest", {"page_size": 20}, 4)])
def test_chunkkv_and_quest_scores_rank_the_rows_their_selectors_keep(name, overrides, ratio, tiny, tiny_ids):
    """As ScorerPress, kvpress's own top-k of score() keeps the rows compress() keeps (the selector, ties to the
    earlier row), read in one hook call on the same keys. The budgets are whole chunks (100 - 20 window = 8 chunks
    of 10) and whole pages (100 - 20 current = 4 pages of 20): inside a chunk or page every row scores the same."""
    press = press_of(name, ratio, **overrides)
    assert isinstance(press, KvzooScorerPress) and isinstance(press, kvpress.ScorerPress)
    agree = []
    compress = press.compress

    def both(module, hidden_states, keys, values, attentions, kwargs):
        ours = compress(module, hidden_states, keys, values, attentions, kwargs)
        topk = kvpress.ScorerPress.compress(press, module, hidden_states, keys, values, attentions, kwargs)
        agree.append(torch.equal(rows_of(ours[0], keys), rows_of(topk[0], keys)))
        return ours

    press.compress = both
    with torch.no_grad(), press(tiny):
        tiny.model(input_ids=tiny_ids, past_key_values=DynamicCache())
    assert agree == [True] * tiny.config.num_hidden_layers


def test_every_press_to_press_accepts_is_a_scorer_press_and_full_is_refused_by_wrappers(tiny, tiny_ids, kv):
    for name in PRESSES:
        press = press_of(name, 4)
        assert isinstance(press, KvzooScorerPress), name
        chunked = kv.cache(tiny, tiny_ids, kvpress.ChunkKVPress(press=press, chunk_length=20))
        assert [layer.keys.shape[2] for layer in chunked.layers] == [100] * 3, name
    full = to_press(registry.get("full"))
    assert isinstance(full, KvzooPress) and not isinstance(full, kvpress.ScorerPress)  # it keeps every row: no score
    with pytest.raises(AssertionError, match="requires a ScorerPress"):
        kvpress.ChunkKVPress(press=full, chunk_length=20)


def test_a_layer_scored_in_parts_reuses_the_same_part_of_its_group_leader(tiny, kv):
    """ChunkPress scores each layer in parts; chunkkv's index reuse (reuse=2) takes part i of layer 1 from part i of
    layer 0, so the two layers keep the same positions (layer 2 leads the next group)."""
    press = kvpress.ChunkPress(press=press_of("chunkkv", 2, window=4, chunk_size=4), chunk_length=48)
    kept = kv.press_rows(tiny, _ids(192), press)
    assert [layer.shape for layer in kept] == [(1, 2, 96)] * 3
    assert torch.equal(kept[0], kept[1])
