"""The policy surface (issue 35): RowsView's rows by age read by slot whatever the rows' order, values on MLA rows,
StreamingLLM's rule stated once (selector, per-step victim, token-by-token prefill), H2O's accumulation stated
once, and the schedule read as data."""

from __future__ import annotations

import pytest
import torch

from kvzoo import registry
from kvzoo.framework.policy import RowsView, _sinks_and_recent_victim, sinks_and_recent
from kvzoo.framework.runtime import rows_between_events
from kvzoo.kernels.attention import attention_reference, received_attention, row_mask


def _rows(B=2, G=2, N=12, pad=(0, 3), seed=0, shuffle=True, **where) -> tuple[RowsView, torch.Tensor]:
    """Rows of a left-padded batch (sequence b has ``pad[b]`` padding slots first), shuffled per (b, g); and the
    permutation (``perm[b, g, i]``: the slot-order index of row i)."""
    g = torch.Generator().manual_seed(seed)
    slots = torch.arange(N).expand(B, G, N).clone()
    valid = slots >= torch.tensor(pad).view(B, 1, 1)
    perm = torch.stack([torch.stack([torch.randperm(N, generator=g) if shuffle else torch.arange(N)
                                     for _ in range(G)]) for _ in range(B)])
    keys = torch.randn(B, G, N, 8, generator=g)
    view = RowsView(keys=keys.gather(2, perm[..., None].expand(-1, -1, -1, 8)), values=None,
                    slots=slots.gather(2, perm), valid=valid.gather(2, perm), layer_idx=0, num_layers=1, **where)
    return view, perm


@pytest.mark.parametrize("n", [0, 1, 3, 9, 20])
def test_sinks_and_recent_are_read_by_slot_whatever_the_rows_order(n):
    ordered, _ = _rows(shuffle=False)
    shuffled, perm = _rows()
    for name in ("sinks", "recent"):
        want = getattr(ordered, name)(n).gather(2, perm)  # the ordered answer, moved with the rows
        assert torch.equal(getattr(shuffled, name)(n), want), name
    valid_rank = ordered.valid.long().cumsum(-1) - 1  # rows in sequence order: rank among valid rows
    n_valid = ordered.valid.sum(-1, keepdim=True)
    assert torch.equal(ordered.sinks(n), ordered.valid & (valid_rank < n))
    assert torch.equal(ordered.recent(n), ordered.valid & (valid_rank >= n_valid - n))
    for sinks in (0, 2, 5):  # the rule is the accessors' union, on any row order
        assert torch.equal(sinks_and_recent(shuffled.slots, shuffled.valid, sinks, n),
                           shuffled.sinks(sinks) | shuffled.recent(n))


def test_values_on_mla_rows_are_the_content_latent():
    latent = torch.randn(1, 1, 5, 576)
    view = RowsView(keys=latent, values=None, slots=torch.arange(5).view(1, 1, 5), valid=torch.ones(1, 1, 5, dtype=bool),
                    layer_idx=0, num_layers=1, layout="mla", branch_dim=64)
    assert view.values.shape == (1, 1, 5, 512) and torch.equal(view.values, latent[..., :512])
    gqa = RowsView(keys=latent, values=None, slots=view.slots, valid=view.valid, layer_idx=0, num_layers=1)
    assert gqa.values is None  # a GQA view without values says so


@pytest.mark.parametrize("sinks", [0, 1, 4])
def test_the_step_victim_is_the_row_the_rule_leaves_out(sinks):
    """StreamingLLM's per-step victim (one top-k) is the row ``sinks_and_recent(.., N - 1 - sinks)`` does not keep --
    or, where a sequence has padding, the first one the selector's ranking drops -- on shuffled rows."""
    for seed in range(5):
        rows, _ = _rows(seed=seed, pad=(0, 3))
        N = rows.num_rows
        victim = _sinks_and_recent_victim(rows.slots, rows.valid, sinks)
        policy = registry.get("streaming_llm", budget=N - 1, sinks=sinks)
        kept = sinks_and_recent(rows.slots, rows.valid, sinks, N - 1 - sinks)
        assert torch.equal(kept.sum(-1)[0], torch.full((2,), N - 1))  # unpadded: the rule keeps all but one
        assert torch.equal(victim[0], (~kept[0]).long().argmax(-1))
        # padded: the ranking drops the earliest padding row first (the selector leaves the same row out)
        ranked = policy.priority(rows, N - 1)
        padding_slots = torch.where(rows.valid[1], torch.iinfo(torch.long).max, rows.slots[1])
        assert torch.equal(victim[1], padding_slots.argmin(-1))
        assert torch.equal(ranked[1].gather(-1, victim[1, :, None])[:, 0], ranked[1].masked_fill(rows.valid[1], 1e9).amin(-1))


def _old_sink_window_mask(valid, queries, sinks, window):
    """The per-token window as kvzoo stated it before issue 35 (rows in sequence order, the queries' rows last)."""
    rank = valid.long().cumsum(-1) - 1
    q_rank = rank[..., -queries:]
    is_sink = (valid & (rank < sinks))[:, :, None, :]
    return is_sink | ((q_rank[..., :, None] - rank[..., None, :]) < window)


@pytest.mark.parametrize("sinks,window", [(0, 3), (2, 4), (4, 1), (3, 20)])
def test_the_token_by_token_prefill_reads_the_same_rule(sinks, window):
    """The per-query form of ``sinks_and_recent`` gives every query the rows the ordered mask did, once causality
    and padding are applied (what the attention reads)."""
    rows, _ = _rows(shuffle=False, pad=(0, 3), N=14)
    q = 6
    q_slots = torch.arange(14 - q, 14)
    allowed = row_mask(rows.slots, rows.valid, q_slots)
    new = sinks_and_recent(rows.slots, rows.valid, sinks, window, query_slots=q_slots) & allowed
    old = _old_sink_window_mask(rows.valid, q, sinks, window) & allowed
    assert torch.equal(new, old)


def test_h2o_accumulation_is_one_statement():
    """received_attention: the probability each row received, summed over the queries and its group's heads."""
    g = torch.Generator().manual_seed(0)
    B, H, G, q, n = 2, 6, 2, 5, 9
    probs = torch.rand(B, H, q, n, generator=g)
    want = probs.view(B, G, H // G, q, n).sum(dim=(2, 3))
    assert torch.allclose(received_attention(probs, G), want)
    query, keys = torch.randn(B, H, q, 8, generator=g), torch.randn(B, G, n, 8, generator=g)
    slots = torch.arange(n).expand(B, G, n)
    valid = torch.ones(B, G, n, dtype=torch.bool)
    _, sums = attention_reference(query, keys, keys, slots, valid, torch.arange(n - q, n), 0.3, column_sums=True)
    scores = torch.einsum("bhqd,bhnd->bhqn", query, keys.repeat_interleave(H // G, 1)) * 0.3
    mask = row_mask(slots, valid, torch.arange(n - q, n))[:, :, None].expand(B, G, H // G, q, n).reshape(B, H, q, n)
    direct = torch.softmax(scores.masked_fill(~mask, -torch.inf), -1)
    assert torch.allclose(sums, received_attention(direct, G), atol=1e-6)


def test_the_schedule_is_data():
    """How many rows a tier gains between events comes from the schedule; Quest's kernel rule states a page."""
    assert rows_between_events(registry.get("streaming_llm", budget=8)) == 1
    assert rows_between_events(registry.get("streaming_llm", budget=8, schedule="block", block_size=16)) == 16
    assert rows_between_events(registry.get("vestige", ratio=4, block_size=64)) == 64
    assert rows_between_events(registry.get("snapkv", ratio=4)) is None
    assert rows_between_events(registry.get("quest", budget=64)) == 1
    assert rows_between_events(registry.get("quest", budget=64, rule="kernel", page_size=8)) == 8
    quest = registry.get("quest", budget=64, page_size=8, gqa="group")
    assert {name: getattr(quest, name) for name in quest.retriever_fields} == {"page_size": 8, "gqa": "group",
                                                                              "rule": "eval"}
    for gone in ("new_row_stats", "is_dense", "retriever_params"):
        assert not hasattr(quest, gone)
