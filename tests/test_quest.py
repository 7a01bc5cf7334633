"""Quest's page index, composition of selectors and retrievers, and the retrieval accounting."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvzoo import TieredCache, pipeline, registry
from kvzoo.framework.retrieval import ArchiveView, build_retriever
from kvzoo.kernels.index_scan import exact_scores
from kvzoo.retrievers.quest import PageIndex, QuestRetriever


def _archive(keys, budget=None):
    """The archive as a retriever sees it: all of ``keys`` archived, every row valid."""
    B, G, m = keys.shape[:3]
    return ArchiveView(keys, torch.arange(m).expand(B, G, m), torch.ones(B, G, m, dtype=torch.bool), budget)


def _index(state, keys):
    """Archive ``keys`` (all valid) into the page index ``state``."""
    valid = torch.ones(keys.shape[:3], dtype=torch.bool)
    state.index({"keys": keys, "valid": valid}, ArchiveView(keys, valid=valid), _archive(keys[:, :, :0]))


@settings(max_examples=60, deadline=None)
@given(m=st.integers(1, 70), d=st.integers(1, 24), heads=st.sampled_from([1, 2, 4]), seed=st.integers(0, 2**16))
def test_page_bound_covers_the_best_row_of_each_page(m, d, heads, seed):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(1, 1, m, d, generator=g) * 4
    state = PageIndex(QuestRetriever(page_size=16))
    _index(state, keys)
    q = torch.randn(1, heads, 2, d, generator=g) * 3
    bounds = state.bounds(q, 0.7)  # [1, H, 2, p]
    exact = exact_scores(q, keys, 0.7)
    pages = -(-m // 16)
    padded = torch.full((1, heads, 2, pages * 16), float("-inf"))
    padded[..., :m] = exact
    assert (bounds >= padded.view(1, heads, 2, pages, 16).amax(-1)).all()


def test_incremental_index_equals_one_shot():
    g = torch.Generator().manual_seed(1)
    keys = torch.randn(2, 3, 53, 8, generator=g)
    one, parts = PageIndex(QuestRetriever()), PageIndex(QuestRetriever())
    _index(one, keys)
    for a, b in [(0, 5), (5, 21), (21, 22), (22, 53)]:
        _index(parts, keys[:, :, a:b])
    assert torch.equal(one.pages.get("entries"), parts.pages.get("entries"))  # [max, min, max |k|] per page


@pytest.mark.parametrize("seed", range(5))
def test_page_with_the_planted_best_key_is_selected(seed):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(1, 2, 160, 16, generator=g)
    q = torch.randn(1, 4, 1, 16, generator=g)
    planted = int(torch.randint(0, 160, (1,), generator=g))
    keys[0, 1, planted] = q[0, 3, 0] * 3  # KV head 1's best key, for its query head 3
    for gqa, rows in (("group", 32), ("head", 64)):  # one page set per group; each of the group's 2 heads its own
        state = PageIndex(QuestRetriever(pages=2, gqa=gqa))
        _index(state, keys)
        choice = state.choose(q, None, 1.0, _archive(keys, budget=32)).as_mask(160)
        assert choice[0, 1, planted] and int(choice[0, 1].sum()) <= rows


def test_quest_fetching_every_page_equals_full(tiny):
    ctx = torch.randint(1, 256, (300,), generator=torch.Generator().manual_seed(2))
    q, a = ctx[:6], ctx[10:20]
    everything = build_retriever("quest", pages=10_000)
    policy = registry.get("quest", ratio=8, dense_layers=0, retriever=everything)
    full = pipeline.score(tiny, None, ctx, q, a, "full")
    got = pipeline.score(tiny, None, ctx, q, a, policy)
    assert got.stats.totals["archived_rows"] > 0
    assert max(abs(x - y) for x, y in zip(full.token_nll, got.token_nll)) < 1e-4


@pytest.mark.parametrize("rule", ["eval", "kernel"])
def test_quest_keeps_everything_and_first_layers_dense(tiny, rule):
    ctx = torch.randint(1, 256, (400,), generator=torch.Generator().manual_seed(3))
    policy = registry.get("quest", ratio=8, dense_layers=1, rule=rule)
    r = pipeline.generate(tiny, None, ctx, ctx[:5], policy, max_new_tokens=6, audit=True)
    layers = r.stats.layers
    assert layers[0].resident_rows == layers[0].seen_rows and layers[0].archived_rows == 0
    for s in layers[1:]:
        # everything is kept, nothing dropped: eval archives every row after its forward (the current page is the
        # archive's last page); kernel keeps the current page attended, completed pages archived
        assert s.resident_rows == (0 if rule == "eval" else s.seen_rows % 16)
        assert s.resident_rows + s.archived_rows == s.seen_rows and s.dropped_rows == 0
        # B = 400 // 8 = 50 rows: eval reads max(3, 50 // 16) = 3 archived pages per query head (the last step's
        # current page is one of the candidates, 9 rows of it indexed), kernel 50 // 16 - 1 = 2 besides the
        # current page; a KV group fetches the union of its 2 heads' pages (2 KV heads)
        pages = 3 if rule == "eval" else 2
        assert (pages - 1) * 16 * 2 < s.last_step["rows_fetched"] <= 2 * pages * 16 * 2
        assert s.policy_info["bound_violations"] == 0
    with pytest.raises(ValueError, match="archive must be True"):
        registry.get("quest", ratio=8, archive=False)


@pytest.mark.parametrize(
    "name, params",
    [
        ("snapkv", {"retriever": "vestige"}),
        ("h2o", {"retriever": "quest"}),
        ("vestige", {"retriever": None}),
        ("vestige", {}),
        ("streaming_llm", {"retriever": "vestige"}),
        ("chunkkv", {"retriever": "quest"}),
    ],
)
def test_any_selector_with_any_retriever(tiny, name, params):
    policy = registry.get(name, ratio=4, **params)
    ctx = torch.randint(1, 256, (500,), generator=torch.Generator().manual_seed(4))
    r = pipeline.generate(tiny, None, ctx, ctx[:6], policy, max_new_tokens=5, audit=True)
    t = r.stats.totals
    assert len(r.token_ids) == 5
    if policy.retriever is None:  # eviction only: the evicted rows are dropped (no archive to fetch from)
        assert t["fetched_rows"] == 0 and "rows_scanned" not in t and t["dropped_rows"] > 0 and t["archived_rows"] == 0
    else:
        assert t["archived_rows"] > 0 and t["dropped_rows"] == 0
        assert t["retrieval_steps"] > 0 and t["rows_scanned"] > 0 and t["bound_violations"] == 0
        assert t["kv_bytes_read"] == t["attended_bytes_read"] + t["index_bytes_scanned"] + t["fetched_bytes"]


def test_vestige_on_gqa_reads_the_key(tiny):
    policy = registry.get("vestige", ratio=4, retriever=None)
    ctx = torch.randint(1, 256, (400,), generator=torch.Generator().manual_seed(5))
    cache = TieredCache(tiny, policy, context_length=400)
    with torch.no_grad():
        tiny(input_ids=ctx[None], cache=cache, use_cache=True)
    cache.compress()
    t = cache.stats().totals
    head_dim, kv_heads = tiny.config.head_dim, tiny.config.num_key_value_heads
    assert t["selector_rows_read"] == 3 * kv_heads * 400
    assert t["selector_bytes_read"] == t["selector_rows_read"] * head_dim * 4
    with pytest.raises(ValueError, match="needs MLA rows"):
        c2 = TieredCache(tiny, registry.get("vestige", ratio=4, branch="rope"))
        tiny(input_ids=ctx[None], cache=c2, use_cache=True)
        c2.compress()


def test_retriever_errors():
    with pytest.raises(KeyError, match="valid: vestige, quest"):
        build_retriever("pages")
    with pytest.raises(TypeError, match="unknown parameter"):
        build_retriever("vestige", k=3)
    with pytest.raises(ValueError, match="j must be"):
        build_retriever("vestige", j=0)


# --- rule="eval": the current page is scored with the step's own key, as the reference's evaluation code does -------


def _reference_eval_rows(query, keys, budget, size=16):
    """Issue 36's independent restatement of mit-han-lab/Quest ``evaluation/quest_attention.py`` at one decode step:
    the new key joins the key states (``keys [G, L, D]``, the step's own key last) before any page is scored; pages
    of ``size`` from the first token, bound ``sum_i max(q_i min_i, q_i max_i)`` (fp64), the top
    ``min(max(3, B // size), pages)`` over all pages; per query head (``query [H, D]``). The rows each head reads."""
    H, G, L = query.shape[0], keys.shape[0], keys.shape[1]
    n_pages = -(-L // size)
    out = []
    for h in range(H):
        k, q = keys[h // (H // G)].double(), query[h].double()
        pages = [k[p * size:(p + 1) * size] for p in range(n_pages)]
        bound = torch.stack([torch.maximum(q * page.amin(0), q * page.amax(0)).sum() for page in pages])
        top = bound.topk(min(max(3, budget // size), n_pages)).indices.tolist()
        out.append({r for p in top for r in range(p * size, min(L, (p + 1) * size))})
    return out


def _kvzoo_eval_rows(query, keys, budget, capacity, with_own=True):
    """The archived rows each query head reads with kvzoo's eval rule at that step (every row but the own one
    archived and indexed; the step's own row in the view as a decode step's view carries it), plus the own row."""
    G, L, D = keys.shape
    H = query.shape[0]
    state = PageIndex(QuestRetriever(), capacity)
    storage = keys[None]  # [1, G, L, D]: the layer's storage, the own row last
    valid = torch.ones(1, G, L, dtype=torch.bool)
    _index(state, storage[:, :, : L - 1])
    own = (lambda: (storage, valid, torch.full((1, G), L - 1))) if with_own else None
    view = ArchiveView(storage[:, :, : L - 1], torch.arange(L - 1).expand(1, G, L - 1), valid[:, :, : L - 1], budget,
                       own_row=own)
    choice = state.choose(query[None, :, None], None, 1.0, view)
    rows, ok = choice.rows.view(G, H // G, -1), choice.ok.view(G, H // G, -1)  # each head's own segment
    return [set(rows[h // (H // G), h % (H // G)][ok[h // (H // G), h % (H // G)]].tolist()) | {L - 1}
            for h in range(H)]


@pytest.mark.parametrize("kernels", ["auto", "torch"])  # the C op and its reference
@pytest.mark.parametrize("capacity", [None, 260])  # a growing page summary, a fixed one
@pytest.mark.parametrize("L", [201, 209, 193, 17])  # the current page partial (201, 209) or opened by the step
@pytest.mark.parametrize("budget", [31, 64, 100])
def test_eval_rule_scores_the_current_page_with_the_steps_own_key(kernels, capacity, L, budget, monkeypatch):
    """Issue 36: the current page's min/max include the step's own key (a key of its own, no copy of an earlier one:
    its page's earlier rows are planted worst for query head 0 and the own key best, so only the own key can make
    the page rank). Each head reads what the reference's eval rule reads (restated above), plus its own row, which
    kvzoo always attends; without the own key the page would not be read."""
    monkeypatch.setenv("KVZOO_KERNELS", kernels)
    g = torch.Generator().manual_seed(L + budget)
    G, H, D = 2, 4, 16
    keys = torch.randn(G, L, D, generator=g)
    query = torch.randn(H, D, generator=g)
    start = (L - 1) // 16 * 16  # the current page's first row
    keys[0, start:L - 1] = -query[0] * 3  # head 0's worst rows...
    keys[0, L - 1] = query[0] * 6  # ...and the step's own key its best
    ref = _reference_eval_rows(query, keys, budget)
    got = _kvzoo_eval_rows(query, keys, budget, capacity)
    for h in range(H):
        assert got[h] == ref[h] | {L - 1}, (h, sorted(got[h] ^ (ref[h] | {L - 1})))
    assert L - 1 in ref[0]  # the current page is head 0's: read whole where it has rows before the own one
    if start < L - 1:
        assert set(range(start, L - 1)) <= got[0]
        assert not set(range(start, L - 1)) & _kvzoo_eval_rows(query, keys, budget, capacity, with_own=False)[0]


@pytest.mark.parametrize("ratio", [4, 8])
def test_eval_rule_pages_through_the_model_match_the_reference_rule(ratio):
    """Issue 36 through a tiny Llama: every decode step's archived rows per query head (``dense_layers=0``) equal
    those of the reference's eval rule restated on the layer's keys (``benchmarks/probe.py quest-page``, the
    probe behind the figures in docs/fidelity.md), the step's own row left out on both sides."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import probe

    figures = probe.quest_page_observe(ratio, context=240, steps=24, seed=1)
    assert figures["head_steps"] == 23 * 3 * 4  # steps after the first token x layers x query heads
    assert figures["differ"] == 0, figures
    assert figures["reference_reads_current_page"] > 0


@pytest.mark.parametrize(("name", "params", "carried"), [
    ("quest", {}, True),  # eval: the step's row is the archive's next row
    ("quest", {"rule": "kernel"}, False),  # the current page stays attended
    ("h2o", {"retriever": "quest"}, False),  # another selector: the archive's last page is not the step's
    ("streaming_llm", {"retriever": "quest"}, False),
])
def test_a_decode_steps_view_carries_its_own_row_where_the_policy_archives_it_next(tiny, name, params, carried):
    """Issue 36: the current page is scored with the step's key only where the step's row joins it next; under
    another selector Quest's retriever scores the archive's pages as they are."""
    cache = TieredCache(tiny, registry.get(name, ratio=4, **params))
    ids = torch.randint(1, 256, (1, 120), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        token = tiny(input_ids=ids, cache=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
        cache.compress()
        tiny(input_ids=token, position_ids=torch.tensor([[120]]), cache=cache, use_cache=True)
    layer = cache.tiered_layers[-1]
    own = layer.store.archive.view(layer.store.budget, whole=True, step=True).own_row
    assert (own is not None) == carried
    if carried:  # the storage whole, the latest row's position: the step's own key
        keys, valid, position = own
        assert torch.equal(keys.gather(2, position[..., None, None].expand(-1, -1, 1, keys.shape[-1]))[:, :, 0],
                           layer.store.rows.get("keys")[:, :, -1]) and valid.gather(2, position[..., None]).all()


@pytest.mark.parametrize("capacity", [None, 64])
@pytest.mark.parametrize("blocks", [[(0, 40)], [(0, 7), (7, 20), (20, 21), (21, 22), (22, 40)], [(0, 13)] + [
    (i, i + 1) for i in range(13, 40)]], ids=["one", "blocks", "rows"])
def test_pages_of_a_padded_sequence_start_at_its_first_real_row(blocks, capacity):
    """Issue 44 item 2: a sequence left-padded by 13 rows (not a multiple of the 8-row page) is summarised in the
    same pages as alone -- its padding ahead in empty pages of their own -- whether its rows join in one block, in
    blocks or one at a time (a fixed summary's one-row path): the page entries of its real rows are alone's, and a
    batch companion without padding keeps pages at row 0."""
    g = torch.Generator().manual_seed(3)
    pad, size, real = 13, 8, 27
    keys = torch.randn(2, 2, pad + real, 4, generator=g)
    valid = torch.ones(2, 2, pad + real, dtype=torch.bool)
    valid[0, :, :pad] = False  # sequence 0: left padding; sequence 1: none
    alone, padded, companion = (PageIndex(QuestRetriever(page_size=size), capacity) for _ in range(3))
    view = ArchiveView(keys[:1, :, :0], valid=valid[:1, :, :0])  # no padding
    alone.index({"keys": keys[:1, :, pad:], "valid": valid[:1, :, pad:]}, view, view)
    companion.index({"keys": keys[1:], "valid": valid[1:]}, view, view)
    for a, b in blocks:
        empty = ArchiveView(keys[:, :, :0], padded=True)
        padded.index({"keys": keys[:, :, a:b], "valid": valid[:, :, a:b]}, empty, empty)
    assert padded.page_shift.tolist() == [[3, 3], [0, 0]]  # 13 + 3 = 16: the first real row opens page 2
    first, pages = (pad + 3) // size, -(-real // size)
    entries, empty_pages = padded.pages.buffers["entries"], padded.pages.buffers["empty"]
    assert torch.equal(entries[0, :, first : first + pages], alone.pages.get("entries")[0, :, :pages])
    assert empty_pages[0, :, :first].all() and not empty_pages[0, :, first : first + pages].any()
    n = companion.pages.get("entries").shape[2]
    assert torch.equal(entries[1, :, :n], companion.pages.get("entries")[0])
