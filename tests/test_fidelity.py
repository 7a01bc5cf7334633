"""Fidelity to the reference code: the twins reload identically, Quest's rules, the multi-token rule every
retriever shares, the read accounting, StreamingLLM's token-by-token prefill, and SnapKV / H2O keeping
the rows the reference's own algorithm keeps."""

import json
import math
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from kvzoo import TieredCache, pipeline, registry
from kvzoo.framework.policy import RowsView
from kvzoo.framework.retrieval import ArchiveView
from kvzoo.kernels.attention import window_attention
from kvzoo.models import tiny_llama
from kvzoo.policies.h2o import H2O
from kvzoo.policies.snapkv import SnapKV
from kvzoo.refmodel import CHECKPOINT_DIR
from kvzoo.retrievers.quest import PageIndex, QuestRetriever

SHIPPED = sorted(p.name for p in CHECKPOINT_DIR.iterdir() if (p / "model.safetensors").is_file())

# --- the reference twins load the same weights and frequencies in every process ------------------------

_LOAD_AND_PRINT = """
import json, sys, torch
from kvzoo import pipeline
from kvzoo.models import load_model
out = {}
for name, record_path in zip(sys.argv[1::2], sys.argv[2::2]):
    model, _ = load_model(name.removesuffix("-s0"))
    record = json.load(open(record_path))
    ex = record["examples"][0]
    ids = torch.tensor([ex["context"] + ex["question"]])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, -1]
    answers = [pipeline.generate(model, None, e["context"], e["question"], "full", max_new_tokens=1).token_ids[0]
               for e in record["examples"]]
    out[name] = {"logits": logits.tolist(), "answers": answers}
print(json.dumps(out))
"""


def _fresh_process_run(names: list[str]) -> dict:
    """Every checkpoint of ``names`` loaded (each from its files) in one new Python process: name -> logits, answers."""
    args = [str(a) for name in names for a in (name, CHECKPOINT_DIR / name / "training_record.json")]
    out = subprocess.run([sys.executable, "-c", _LOAD_AND_PRINT, *args], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def two_fresh_processes() -> tuple[dict, dict]:
    """Two new processes, each loading every shipped checkpoint (two processes, not two per checkpoint: a process
    start imports torch and transformers, most of what this costs)."""
    return _fresh_process_run(SHIPPED), _fresh_process_run(SHIPPED)


@pytest.mark.parametrize("name", SHIPPED)
def test_checkpoint_reloads_identically_in_two_fresh_processes(name, two_fresh_processes):
    record = json.loads((CHECKPOINT_DIR / name / "training_record.json").read_text())
    first, second = (run[name] for run in two_fresh_processes)
    # two processes agree to rounding (bit for bit is not promised: BLAS may round another way under other threads)
    torch.testing.assert_close(torch.tensor(first["logits"]), torch.tensor(second["logits"]), rtol=1e-5, atol=1e-5)
    assert first["answers"] == second["answers"] == [ex["model_answer"] for ex in record["examples"]]


# --- Quest ---------------------------------------------------------------------------------------------


def _ids(n, seed, vocab=256):
    return torch.randint(1, vocab, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("ratio", [2, 8, 32])
def test_quest_scores_a_question_and_answer_densely_like_full(tiny, ratio):
    """The reference attends densely whenever a forward has more than one query: question + answer in one
    forward see every row, so the answer's NLL equals full's whatever the ratio."""
    ctx, q, a = _ids(400, 1), _ids(7, 2), _ids(9, 3)
    full = pipeline.score(tiny, None, ctx, q, a, "full")
    got = pipeline.score(tiny, None, ctx, q, a, registry.get("quest", ratio=ratio, dense_layers=0))
    assert got.stats.totals["archived_rows"] > 0
    assert max(abs(x - y) for x, y in zip(full.token_nll, got.token_nll)) < 1e-4


def _page_index(keys, gqa="head", pages=None):
    state = PageIndex(QuestRetriever(gqa=gqa, pages=pages))
    valid = torch.ones(keys.shape[:3], dtype=torch.bool)
    state.index({"keys": keys, "valid": valid}, ArchiveView(keys, valid=valid), None)
    B, G, m = keys.shape[:3]
    return state, ArchiveView(keys, torch.arange(m).expand(B, G, m), valid, budget=None)


@pytest.mark.parametrize("seed", range(4))
def test_per_query_head_selection_contains_every_heads_own_top_pages(seed):
    """Planted: each query head of a KV group has a different best page; every one is fetched, and each head
    reads only its own pages (the reference selects per query head)."""
    g = torch.Generator().manual_seed(seed)
    B, G, H, D, m = 1, 2, 6, 16, 320
    keys = torch.randn(B, G, m, D, generator=g)
    query = torch.randn(B, H, 1, D, generator=g)
    planted = torch.randperm(m // 16, generator=g)[:H] * 16 + 5
    for h in range(H):
        keys[0, h // (H // G), planted[h]] = query[0, h, 0] * 4  # head h's best key
    state, view = _page_index(keys, pages=3)
    choice = state.choose(query, None, 1.0, view)
    bounds = state.bounds(query, 1.0)  # [B, H, 1, p]
    mask = choice.as_mask(m)
    assert choice.head_valid is not None  # a decode step: each head's own rows, one segment per head of its group
    hpg = H // G
    rows_of = choice.rows.view(B, G, hpg, -1)
    ok_of = choice.ok.view(B, G, hpg, -1)
    visible = torch.zeros(B, H, m, dtype=torch.bool)
    for h in range(H):
        visible[0, h, rows_of[0, h // hpg, h % hpg][ok_of[0, h // hpg, h % hpg]]] = True
    for h in range(H):
        own = bounds[0, h, 0].topk(3).indices
        rows = (own[:, None] * 16 + torch.arange(16)).flatten()
        g_ = h // (H // G)
        assert mask[0, g_, rows].all() and mask[0, g_, planted[h]]
        assert visible[0, h, rows].all() and int(visible[0, h].sum()) == 3 * 16  # its own pages only


def test_group_rule_fetches_one_page_set_per_kv_group():
    g = torch.Generator().manual_seed(9)
    keys = torch.randn(1, 2, 160, 16, generator=g)
    query = torch.randn(1, 4, 1, 16, generator=g)
    state, view = _page_index(keys, gqa="group", pages=2)
    choice = state.choose(query, None, 1.0, view)
    assert choice.head_valid is None and (choice.as_mask(160).sum(-1) == 32).all()


def quest_reference_reads(query, keys, budget, page_size, rule):
    """The rows each query head reads at one decode step by Quest's reference rules, restated from the reference
    (mit-han-lab/Quest) on the whole sequence ``keys [G, L, D]`` (the step's own key last) for ``query [H, D]``.

    eval (``evaluation/quest_attention.py``, ``local_heavy_hitter_mask``): pages of ``page_size`` from the first
    token, each scored by ``sum_i max(q_i min_i, q_i max_i)``; the top ``min(max(3, B // page_size), pages)``
    pages over all pages, the current one included but not forced. kernel (``quest/utils/controller.py``,
    ``quest/models/llama.py``): ``page_budget = B // page_size``; all pages when there are no more than that,
    else the last page plus the top ``min(page_budget, pages) - 1`` of the others. Per query head (repeat_kv)."""
    H, G, L = query.shape[0], keys.shape[0], keys.shape[1]
    pages = -(-L // page_size)
    out = []
    for h in range(H):
        k = keys[h // (H // G)].double()
        q = query[h].double()
        bound = torch.stack([torch.maximum(q * k[p * page_size:(p + 1) * page_size].amin(0),
                                           q * k[p * page_size:(p + 1) * page_size].amax(0)).sum()
                             for p in range(pages)])
        if rule == "eval":
            chosen = set(bound.topk(min(max(3, budget // page_size), pages)).indices.tolist())
        else:
            page_budget = budget // page_size
            if pages <= page_budget:
                chosen = set(range(pages))
            else:
                others = max(0, min(page_budget, pages) - 1)
                chosen = {pages - 1} | set(bound[:-1].topk(others).indices.tolist())
        out.append({r for p in chosen for r in range(p * page_size, min(L, (p + 1) * page_size))})
    return out


def quest_kvzoo_reads(query, keys, budget, page_size, rule):
    """The rows each query head reads with kvzoo's ``quest(rule=...)`` at that step: the attended tier (eval: the
    step's own row; kernel: the current page) plus the archived rows its retriever lets the head see (the view
    carries the step's own row, as a decode step's does)."""
    G, L, _ = keys.shape
    archived = L - 1 if rule == "eval" else (L - 1) // page_size * page_size
    state = PageIndex(QuestRetriever(page_size=page_size, rule=rule))
    arch = keys[None, :, :archived]
    valid = torch.ones(arch.shape[:3], dtype=torch.bool)
    if archived:
        state.index({"keys": arch, "valid": valid}, ArchiveView(arch, valid=valid), None)
    storage = keys[None]

    def own_row():  # the layer's storage whole, the step's row last
        return storage, torch.ones(1, G, L, dtype=torch.bool), torch.full((1, G), L - 1)

    view = ArchiveView(arch, torch.arange(archived).expand(1, G, archived), valid, budget=budget, own_row=own_row)
    H = query.shape[0]
    if archived:
        choice = state.choose(query[None, :, None], None, 1.0, view)
        if choice.head_valid is not None:  # each head's own rows, one segment per head of the group
            hpg = H // G
            per_head = choice.rows.view(1, G, hpg, -1)
            ok_head = choice.ok.view(1, G, hpg, -1)
            seen = torch.zeros(1, H, archived, dtype=torch.bool)
            for h in range(H):
                rows = per_head[0, h // hpg, h % hpg][ok_head[0, h // hpg, h % hpg]]
                seen[0, h, rows] = True
        else:
            ok = choice.as_mask(archived)  # [1, G, m]: the group fetched it
            seen = ok.repeat_interleave(H // G, dim=1)
    else:
        seen = torch.zeros(1, H, 0, dtype=torch.bool)
    return [set(torch.nonzero(seen[0, h]).flatten().tolist()) | set(range(archived, L)) for h in range(H)]


def _planted_sequence(seed, L, G=2, H=6, D=16, page_size=16):
    """Random keys and a query; the current page planted to rank first for head 0 and last for head 1 (so the
    eval rule includes it for one head and not the other), and the step's own key a copy of an earlier key of
    its page (so the page's min/max, the bound, is the same with or without it)."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(G, L, D, generator=g)
    query = torch.randn(H, D, generator=g)
    start = (L - 1) // page_size * page_size  # the current page's first row
    if start < L - 1:
        keys[0, start:L - 1] = query[0] * 3  # head 0's group: the current page is its best
        keys[0, L - 1] = keys[0, start]
        keys[1, start:L - 1] = -query[H // G] * 3  # head 3's group: its worst
        keys[1, L - 1] = keys[1, start]
    return query, keys


@pytest.mark.parametrize("rule", ["eval", "kernel"])
@pytest.mark.parametrize("L", [200, 201, 208, 209, 40, 33])
@pytest.mark.parametrize("budget", [15, 31, 64, 100, 1000])
def test_quest_rules_read_what_the_reference_rules_read(rule, L, budget):
    """Planted sequences against the reference's two rules, restated. kernel: the same rows for every head. eval:
    the same rows, except that kvzoo always reads the step's own row (its docstring's deviation); the current page
    is scored with the step's key in it, so at a step that opens a page (L - 1 a multiple of 16) the 1-row current
    page is a candidate as it is in the reference (issue 36: ``tests/test_quest.py`` plants an own key of its own)."""
    for seed in range(3):
        query, keys = _planted_sequence(seed, L)
        ref = quest_reference_reads(query, keys, budget, 16, rule)
        got = quest_kvzoo_reads(query, keys, budget, 16, rule)
        for h in range(query.shape[0]):
            if rule == "kernel":
                assert got[h] == ref[h], (h, sorted(got[h] ^ ref[h]))
            else:
                assert got[h] == ref[h] | {L - 1}, (h, sorted(got[h] ^ (ref[h] | {L - 1})))
    if rule == "eval" and (L - 1) % 16 and budget < 64 and L > 48:  # the planted current page: in for head 0 only
        assert L - 2 in ref[0] and L - 2 not in ref[3]


def test_quest_page_counts_of_both_rules_through_the_model(tiny):
    """B = floor(context / ratio). eval: max(3, B // 16) pages chosen among all pages, the current page (the
    archive's last, partial) among them; kernel: the current page attended plus B // 16 - 1 archived pages
    (none when B < 32). One page set per KV group here (gqa="group"), so the counts are exact."""
    ctx = _ids(500, 4)
    for rule, ratio, pages in (("eval", 4, 7), ("eval", 32, 3), ("kernel", 4, 6), ("kernel", 32, 0)):
        policy = registry.get("quest", ratio=ratio, dense_layers=0, gqa="group", rule=rule)
        r = pipeline.generate(tiny, None, ctx, ctx[:5], policy, max_new_tokens=3)
        for s in r.stats.layers:
            assert s.seen_rows == 507  # the last decode step's token is the 507th row
            fetched = s.last_step["rows_fetched"]  # of the last decode step, both KV groups
            if rule == "eval":  # every row archived after its forward; at the step, 506 rows archived
                assert s.resident_rows == 0 and s.archived_rows == 507
                partial = 506 - 31 * 16  # the current page's rows before the step's own
                assert fetched in (pages * 16 * 2, ((pages - 1) * 16 + partial) * 2)
            else:  # the current page (rows 496..506) attended, 31 complete pages archived
                assert s.resident_rows == 507 % 16 and s.archived_rows == 496
                assert fetched == pages * 16 * 2


def test_quest_page_size_reaches_its_retriever_and_refuses_a_conflict(tiny):
    cache = TieredCache(tiny, registry.get("quest", ratio=4, page_size=4))
    assert cache.retriever.page_size == 4 and cache.retriever.gqa == "head"
    with pytest.raises(ValueError, match="page_size=4 but its retriever has page_size=16"):
        TieredCache(tiny, registry.get("quest", ratio=4, page_size=4, retriever=QuestRetriever(page_size=16)))


def test_quest_index_keeps_the_keys_dtype():
    model = tiny_llama()[0].to(torch.bfloat16)  # its own copy: a round trip through bf16 would alter the shared one
    cache = TieredCache(model, registry.get("quest", ratio=4, dense_layers=0))
    with torch.no_grad():
        model(input_ids=_ids(300, 5)[None], cache=cache, use_cache=True)
    index = cache.layers[0].retrieval
    assert index.pages.buffers["entries"].dtype == torch.bfloat16 and index.entry_bytes == (2 * 16 + 1) * 2


# --- one rule for multi-token forwards, and the reads it costs ------------------------------------------


@pytest.mark.parametrize("retriever", ["vestige", "quest"])
def test_question_forward_reads_are_counted(tiny, retriever):
    """The question's forward reads the archive too: kv_bytes_read includes it (dense: the whole archive)."""
    ctx, question = _ids(600, 6), _ids(20, 7)
    row = 2 * 16 * 4  # one row of one KV head: key + value, head_dim 16, fp32
    for rule in ("dense", "union"):
        policy = registry.get("streaming_llm", ratio=8, retriever=retriever)
        cache = TieredCache(tiny, policy, context_length=600)
        cache.retriever.multi_token = rule
        with torch.no_grad():
            tiny(input_ids=ctx[None], cache=cache, use_cache=True)
            cache.compress()
            before = cache.stats()
            tiny(input_ids=question[None], cache=cache, use_cache=True)
            after = cache.stats()
        for b, a in zip(before.layers, after.layers):
            fetched = a.fetched_rows - b.fetched_rows
            assert fetched > 0
            if rule == "dense":
                assert fetched == b.archived_rows * 2  # every archived row of both KV heads
            tier = b.resident_rows + 20  # the tier at attention time: the budget + the question's rows
            index = a.kv_bytes_read - b.kv_bytes_read - 2 * tier * row - fetched * row
            assert index == (0 if rule == "dense" else a.last_step["index_bytes_scanned"])


def test_multi_token_rule_is_validated():
    with pytest.raises(ValueError, match="multi_token must be one of"):
        QuestRetriever(multi_token="sometimes")


# --- StreamingLLM, token by token --------------------------------------------------------------------


def test_streaming_prefill_stream_is_the_token_by_token_rule(tiny):
    """prefill="stream": each prompt token reads the 4 sinks and the latest budget - 4 rows up to its own --
    a full forward whose mask is that rule gives the same logits at every position."""
    ids = _ids(120, 8)[None]
    budget, sinks = 30, 4
    cache = TieredCache(tiny, registry.get("streaming_llm", budget=budget, prefill="stream"))
    with torch.no_grad():
        got = tiny(input_ids=ids, cache=cache, use_cache=True).logits
        allowed = torch.zeros(120, 120, dtype=torch.bool)
        for t in range(120):
            allowed[t, : min(sinks, t + 1)] = True
            allowed[t, max(0, t - (budget - sinks) + 1) : t + 1] = True
        mask4d = torch.zeros(1, 1, 120, 120).masked_fill(~allowed, float("-inf"))
        ref = tiny(input_ids=ids, attention_mask=mask4d).logits
    assert (got - ref).abs().max().item() < 1e-4
    dense = TieredCache(tiny, registry.get("streaming_llm", budget=budget))
    with torch.no_grad():
        assert (tiny(input_ids=ids, cache=dense, use_cache=True).logits - ref).abs().max().item() > 1e-3


# --- SnapKV and H2O keep the rows the reference's algorithm keeps --------------------------------------


def snapkv_reference_keep(queries, keys, window, capacity, kernel, pooling):
    """``SnapKVCluster.update_kv`` (FasterDecoding/SnapKV) restated: the window's softmax over all rows
    (causal inside the window), summed over the window queries for the rows before the window, pooled,
    top ``capacity - window`` per head, plus the window. MHA: one KV head per query head. Returns the kept
    rows (sorted) and whether the top-k boundary is free of ties (the rule then determines the rows)."""
    H, T, D = queries.shape
    logits = queries[:, -window:] @ keys.transpose(-1, -2) / math.sqrt(D)  # [H, w, T]
    causal = torch.ones(window, window, dtype=torch.bool).tril()
    logits[:, :, -window:] = logits[:, :, -window:].masked_fill(~causal, float("-inf"))
    votes = torch.softmax(logits, dim=-1)[:, :, :-window].sum(dim=1)  # [H, T - w]
    pool = F.avg_pool1d if pooling == "avgpool" else F.max_pool1d
    pooled = pool(votes[:, None], kernel_size=kernel, padding=kernel // 2, stride=1)[:, 0]
    ranked = pooled.sort(dim=-1, descending=True).values
    k = capacity - window
    determined = bool((ranked[:, k - 1] > ranked[:, k]).all())
    top = pooled.topk(k, dim=-1).indices
    kept = torch.cat([top, torch.arange(T - window, T).expand(H, window)], dim=-1).sort(dim=-1).values
    return kept, determined


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("pooling, kernel", [("maxpool", 7), ("avgpool", 5)])
def test_snapkv_keeps_the_reference_rows(seed, pooling, kernel):
    """Planted inputs whose kept rows the reference's rule determines (no tie at the top-k boundary):
    max pooling turns each planted peak into a plateau of ``kernel`` rows, so 6 isolated peaks fill
    exactly ``6 * 7`` kept rows; average pooling has no plateaus."""
    g = torch.Generator().manual_seed(seed)
    H, T, D, window = 4, 200, 32, 16
    capacity = window + (6 * kernel if pooling == "maxpool" else 44)
    keys = torch.randn(1, H, T, D, generator=g) * 0.3
    queries = torch.randn(1, H, T, D, generator=g)
    for h in range(H):  # 6 isolated peaks per head, at least 2 kernels apart, before the window
        peaks = torch.randperm(12, generator=g)[:6] * 15 + 8
        keys[0, h, peaks] += 3 * queries[0, h, -window:].mean(0)
    slots = torch.arange(T).expand(1, H, T)
    valid = torch.ones(1, H, T, dtype=torch.bool)
    attn = window_attention(queries[:, :, -window:], torch.arange(T - window, T), keys, slots, valid, D**-0.5)
    rows = RowsView(keys=keys, values=keys, slots=slots, valid=valid, layer_idx=0, num_layers=1, window_attention=attn)
    policy = SnapKV(budget=capacity, window=window, kernel_size=kernel, pooling=pooling)
    expected, determined = snapkv_reference_keep(queries[0], keys[0], window, capacity, kernel, pooling)
    assert determined, "the planted input should leave no tie at the reference's top-k boundary"
    assert torch.equal(policy.select(rows, capacity)[0], expected)


def h2o_reference_run(attentions, heavy, recent):
    """``H2OKVCache_LayerWise`` (FMInference/H2O, utils_real_drop) restated for one sequence: the scores
    accumulate each forward's attention summed over its queries; when the cache exceeds ``heavy + recent``
    it keeps the ``heavy`` best among all but the ``recent`` latest rows, and the ``recent`` latest.
    ``attentions``: per forward, a function of the kept rows' indices giving that forward's probabilities
    ``[H, q, kept + q]``. Returns the kept original indices after each forward."""
    kept, score, history = None, None, []
    for attention in attentions:
        q = attention["queries"]
        kept = torch.arange(q).expand(attention["heads"], q) if kept is None else torch.cat(
            [kept, torch.full((attention["heads"], q), kept.max() + 1) + torch.arange(q)], dim=-1)
        probs = attention["probs"](kept)  # [H, q, n]
        new = probs.sum(dim=1)
        score = new if score is None else torch.cat([score, torch.zeros(score.shape[0], q)], dim=-1) + new
        n = kept.shape[-1]
        if n > heavy + recent:
            top = score[:, : n - recent].topk(heavy, dim=-1).indices.sort(dim=-1).values
            keep_idx = torch.cat([top, torch.arange(n - recent, n).expand(score.shape[0], recent)], dim=-1)
            kept, score = kept.gather(1, keep_idx), score.gather(1, keep_idx)
        history.append(kept.sort(dim=-1).values.clone())
    return history


def test_h2o_keeps_the_reference_rows_through_prefill_and_decode():
    """Prefill of 60 rows then 30 decode steps, on planted attention (no ties): the rows kvzoo's selector keeps
    after each forward are the reference's, for every head."""
    g = torch.Generator().manual_seed(3)
    H, budget = 3, 20
    policy = H2O(budget=budget)
    heavy, recent = policy.split(budget)
    total = 60 + 30
    logits = torch.randn(H, total, total, generator=g) * 3  # query t's attention logits over rows 0..t

    def probs_for(kept, first, q):
        """Queries first..first+q-1 over the kept rows (original indices), causal: [H, q, n]."""
        out = []
        for t in range(first, first + q):
            lg = logits[:, t].gather(1, kept).masked_fill(kept > t, float("-inf"))
            out.append(torch.softmax(lg, dim=-1))
        return torch.stack(out, dim=1)

    forwards = [{"queries": 60, "heads": H, "probs": lambda kept: probs_for(kept, 0, 60)}]
    forwards += [{"queries": 1, "heads": H, "probs": (lambda t: lambda kept: probs_for(kept, t, 1))(60 + s)}
                 for s in range(30)]
    reference = h2o_reference_run(forwards, heavy, recent)
    # kvzoo: the same forwards through the selector, the accumulator following the kept rows
    kept, score = None, None
    for f, ref_kept in zip(forwards, reference):
        q = f["queries"]
        kept = torch.arange(q).expand(H, q) if kept is None else torch.cat(
            [kept, torch.full((H, q), int(kept.max()) + 1) + torch.arange(q)], dim=-1)
        new = f["probs"](kept).sum(dim=1)
        score = new if score is None else torch.cat([score, torch.zeros(H, q)], dim=-1) + new
        n = kept.shape[-1]
        if n > budget:
            rows = RowsView(keys=torch.zeros(1, H, n, 1), values=None, slots=kept[None], valid=torch.ones(1, H, n,
                            dtype=torch.bool), layer_idx=0, num_layers=1, row_stats={"attention": score[None]})
            keep = policy.select(rows, budget)[0]
            kept, score = kept.gather(1, keep), score.gather(1, keep)
        assert torch.equal(kept, ref_kept)
