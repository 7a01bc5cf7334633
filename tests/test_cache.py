"""TieredCache on Llama-family models: full equivalence, partition invariant, real freeing."""

from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch

from kvzoo import TieredCache, registry
from kvzoo.framework.layer import KVLayer
from kvzoo.framework.policy import Policy, RowsView
from kvzoo.framework.report import layer_stats
from kvzoo.policies.full import Full
from kvzoo.policies.streaming_llm import StreamingLLM
from tests.greedy import assert_same_greedy, generated_logits


@dataclass
class RandomKeep(Policy):
    """Test policy: keeps a random subset (different per batch element and KV head) every step."""

    seed: int = 0
    name: ClassVar[str] = "random_keep"

    @property
    def schedule(self) -> str:
        return "step"

    def priority(self, rows: RowsView, keep: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed + rows.num_rows)
        return torch.rand(rows.slots.shape, generator=g)


def _generate(model, ids, cache=None, n=20, mask=None):
    return model.generate(
        ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False, cache=cache,
        output_logits=True, return_dict_in_generate=True, pad_token_id=0,
    )


def test_full_matches_plain_generate_tiny(tiny):
    ids = torch.randint(1, 256, (1, 300), generator=torch.Generator().manual_seed(1))
    ref = _generate(tiny, ids)
    cache = TieredCache(tiny, Full())
    out = _generate(tiny, ids, cache)
    assert_same_greedy(ref.sequences, out.sequences, generated_logits(ref), generated_logits(out), atol=1e-5)
    totals = cache.stats().totals
    assert totals["archived_rows"] == totals["dropped_rows"] == totals["events"] == 0
    assert cache.get_seq_length() == 319


@pytest.mark.smollm2
def test_full_matches_plain_generate_smollm2(smollm2):
    model, tok = smollm2
    text = " ".join(f"Item {i} is a small note about the weather in town number {i}." for i in range(30))
    ids = tok(text, return_tensors="pt").input_ids[:, :300]
    assert ids.shape[1] == 300
    ref = _generate(model, ids, n=8)
    out = _generate(model, ids, TieredCache(model, "full"), n=8)
    assert_same_greedy(ref.sequences, out.sequences, generated_logits(ref), generated_logits(out), atol=1e-5)


class Recorder:
    """Logs every row appended to a TieredCache (the 'cache that kept everything')."""

    def __init__(self, monkeypatch):
        self.log: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        original = KVLayer.update

        def update(layer, k, v, *a, **kw):
            self.log.setdefault(layer.layer_idx, []).append((k.clone(), v.clone()))
            return original(layer, k, v, *a, **kw)

        monkeypatch.setattr(KVLayer, "update", update)

    def full(self, layer_idx):
        ks, vs = zip(*self.log[layer_idx])
        return torch.cat(ks, dim=2), torch.cat(vs, dim=2)


def _assert_partition(cache, recorder):
    for layer in cache.layers:
        all_k, all_v = recorder.full(layer.layer_idx)
        B, G, T, D = all_k.shape
        arc = layer.store.archive.tensors()
        slots = torch.cat([layer.slots, arc["slots"]], dim=2) if arc else layer.slots
        keys = torch.cat([layer.keys, arc["keys"]], dim=2) if arc else layer.keys
        vals = torch.cat([layer.values, arc["values"]], dim=2) if arc else layer.values
        assert slots.shape[2] == T == layer.counts.seen
        # disjoint and complete: every slot 0..T-1 exactly once per (batch, group)
        assert torch.equal(slots.sort(dim=2).values, torch.arange(T).expand(B, G, T))
        # bit-exact: each row equals the row appended at its slot
        idx = slots[..., None].expand(B, G, T, D)
        assert torch.equal(keys, all_k.gather(2, idx))
        assert torch.equal(vals, all_v.gather(2, idx))


@pytest.mark.parametrize(
    "policy",
    [
        StreamingLLM(budget=40, archive=True),
        StreamingLLM(budget=40, schedule="block", block_size=16, archive=True),
        RandomKeep(budget=33, archive=True),
        StreamingLLM(ratio=4, archive=True),
    ],
    ids=["streaming-step", "streaming-block", "random-per-head", "streaming-ratio"],
)
def test_partition_invariant_batch2_left_padding(tiny, monkeypatch, policy):
    recorder = Recorder(monkeypatch)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(1, 256, (2, 120), generator=g)
    mask = torch.ones_like(ids)
    ids[1, :17] = 0  # left padding on the second sequence
    mask[1, :17] = 0
    cache = TieredCache(tiny, policy)
    _generate(tiny, ids, cache, n=12, mask=mask)
    assert cache.stats().totals["events"] > 0
    _assert_partition(cache, recorder)
    # padding rows are recorded as such and never attended as real tokens
    for layer in cache.layers:
        arc = layer.store.archive.tensors()
        valid = torch.cat([layer.valid, arc["valid"]], dim=2)
        slots = torch.cat([layer.slots, arc["slots"]], dim=2)
        assert not valid[1][slots[1] < 17].any() and valid[1][slots[1] >= 17].all() and valid[0].all()


def test_padded_batch_matches_unpadded_runs(tiny):
    g = torch.Generator().manual_seed(3)
    a, b = torch.randint(1, 256, (1, 90), generator=g), torch.randint(1, 256, (1, 70), generator=g)
    ids = torch.cat([a, torch.cat([torch.zeros(1, 20, dtype=torch.long), b], dim=1)])
    mask = (torch.arange(90) >= torch.tensor([[0], [20]])).long()
    batched = _generate(tiny, ids, TieredCache(tiny, Full()), n=6, mask=mask)
    for row, single in ((0, a), (1, b)):
        alone = _generate(tiny, single, TieredCache(tiny, Full()), n=6)
        assert_same_greedy(alone.sequences[0, -6:], batched.sequences[row, -6:], generated_logits(alone),
                           generated_logits(batched, row), atol=1e-4)


@pytest.mark.parametrize("schedule", ["step", "block"])
def test_streaming_ratio4_keeps_sinks_and_recent_and_frees_bytes(tiny, schedule):
    ids = torch.randint(1, 256, (1, 1000), generator=torch.Generator().manual_seed(4))
    # "step" evicts right after the prefill forward; a block longer than the context waits for compress()
    cache = TieredCache(tiny, registry.get("streaming_llm", ratio=4, schedule=schedule, block_size=4096))
    tiny(input_ids=ids, cache=cache, use_cache=True)
    before = cache.stats()
    cache.compress()
    after = cache.stats()
    budget = 1000 // 4
    expected = torch.cat([torch.arange(4), torch.arange(1000 - (budget - 4), 1000)])
    cfg = tiny.config
    row_bytes = 2 * cfg.num_key_value_heads * cfg.head_dim * 4  # key + value, fp32, all KV heads
    for layer, b, a in zip(cache.layers, before.layers, after.layers):
        assert layer.keys.shape[2] == budget
        assert torch.equal(layer.slots[0, 0], expected) and torch.equal(layer.slots[0, 1], expected)
        assert b.resident_bytes == (1000 if schedule == "block" else budget) * row_bytes
        assert a.resident_bytes == budget * row_bytes
        # eviction only (no retriever): the evicted rows are dropped, counted, and their memory given back
        assert a.archived_rows == 0 and a.dropped_rows == 1000 - budget and a.events == 1
    # decoding continues at the true length, one in / one out
    assert cache.get_seq_length() == 1000
    tiny(input_ids=torch.tensor([[5]]), cache=cache, use_cache=True)
    layer = cache.layers[0]
    assert cache.get_seq_length() == 1001
    assert layer.keys.shape[2] == (budget if schedule == "step" else budget + 1)
    assert layer.slots[0, 0, :4].tolist() == [0, 1, 2, 3] and layer.slots[0, 0, -1].item() == 1000


def test_an_eviction_only_policy_frees_its_storage_and_one_with_a_retriever_keeps_it(tiny):
    """archive=None (the default): no retriever, no archive -- the storage shrinks to the tier at the event; with a
    retriever the storage keeps every row (the archive it fetches from)."""
    ids = torch.randint(1, 256, (1, 600), generator=torch.Generator().manual_seed(6))
    sizes = {}
    for retriever in (None, "vestige"):
        cache = TieredCache(tiny, registry.get("snapkv", ratio=8, window=8, retriever=retriever))
        tiny(input_ids=ids, cache=cache, use_cache=True)
        cache.compress()
        layer = cache.tiered_layers[0]
        sizes[retriever] = layer.store.rows.capacity
        s = layer_stats(layer)
        assert s.resident_rows == 75 and s.archived_rows + s.dropped_rows == 525
        assert (s.archived_rows == 525) == (retriever is not None)
    assert sizes[None] < 200 <= 600 <= sizes["vestige"]


def test_archive_false_drops_and_counts(tiny):
    ids = torch.randint(1, 256, (1, 200), generator=torch.Generator().manual_seed(5))
    cache = TieredCache(tiny, StreamingLLM(budget=50, archive=False))
    tiny(input_ids=ids, cache=cache, use_cache=True)
    cache.compress()
    for s in cache.stats().layers:
        assert (s.resident_rows, s.archived_rows, s.archived_bytes, s.dropped_rows) == (50, 0, 0, 150)


def test_decode_after_eviction_equals_masked_full_forward(tiny):
    """Positions stay true after eviction: one decode step equals a full forward with evicted rows masked."""
    ids = torch.randint(1, 256, (1, 301), generator=torch.Generator().manual_seed(6))
    cache = TieredCache(tiny, StreamingLLM(budget=64))
    tiny(input_ids=ids[:, :300], cache=cache, use_cache=True)
    cache.compress()
    kept = cache.layers[0].slots[0, 0]
    got = tiny(input_ids=ids[:, 300:], cache=cache, use_cache=True).logits[0, -1]
    # reference: plain forward over all 301 tokens; the last query sees only the kept slots and itself
    allowed = torch.tril(torch.ones(301, 301, dtype=torch.bool))
    allowed[300] = False
    allowed[300, kept] = True
    allowed[300, 300] = True
    mask4d = torch.zeros(1, 1, 301, 301).masked_fill(~allowed, float("-inf"))
    ref = tiny(input_ids=ids, attention_mask=mask4d).logits[0, -1]
    assert (got - ref).abs().max().item() < 1e-4


def test_unsupported_architecture_names_supported():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(ValueError, match="supported: llama"):
        TieredCache(model, "full")


def test_bad_policy_arguments(tiny):
    with pytest.raises(TypeError, match="registered name"):
        TieredCache(tiny, 3)
    with pytest.raises(ValueError, match="not a retriever; valid: vestige, quest"):
        registry.get("streaming_llm", ratio=4, retriever="pages")  # names resolve in the registry
    with pytest.raises(ValueError, match="not a retriever; valid: vestige, quest"):
        TieredCache(tiny, StreamingLLM(ratio=4, retriever="pages"))
    with pytest.raises(ValueError, match="archive=False"):
        TieredCache(tiny, StreamingLLM(ratio=4, retriever="quest", archive=False))
    with pytest.raises(ValueError, match="either ratio= or budget="):
        StreamingLLM(ratio=4, budget=10)
    with pytest.raises(ValueError, match="needs a budget"):
        StreamingLLM()
    with pytest.raises(ValueError, match="schedule must be one of"):
        StreamingLLM(ratio=4, schedule="sometimes")
    with pytest.raises(ValueError, match="takes no ratio"):
        Full(ratio=2)


def test_plain_attention_unaffected_by_attach(tiny):
    """With kvzoo attached, a model driven by an ordinary DynamicCache still gives the same outputs."""
    ids = torch.randint(1, 256, (1, 50), generator=torch.Generator().manual_seed(7))
    from kvzoo.framework.attention import attach, detach

    tiny.set_attn_implementation("eager")
    ref = tiny(input_ids=ids).logits
    attach(tiny)
    try:
        got = tiny(input_ids=ids).logits
    finally:
        detach(tiny)
    assert tiny.config._attn_implementation == "eager"
    assert (ref - got).abs().max().item() < 1e-5
