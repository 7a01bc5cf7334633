"""Gemma 3, a hybrid family: the policy acts on the global layers; each sliding-window layer keeps transformers' own
sliding-window cache layer, attended with its window, and counted apart (``untiered``) in every figure."""

from __future__ import annotations

import functools

import pytest
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicSlidingWindowLayer

from kvzoo import TieredCache
from kvzoo.framework.attention import detach
from kvzoo.framework.layer import KVLayer
from kvzoo.models import tiny_gemma3, tiny_llama
from kvzoo.pipeline import prefill
from tests.greedy import assert_same_greedy

PROMPT, STEPS = 80, 12  # the prompt spans 5 windows of 16 rows


@functools.cache
def _model():
    model = tiny_gemma3()[0]
    detach(model)
    return model


def _ids(n: int, batch: int = 1, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 256, (batch, n), generator=torch.Generator().manual_seed(seed))


def _greedy(model, ids, cache, attention_mask=None):
    with torch.no_grad():
        out = model.generate(ids, attention_mask=attention_mask, cache=cache, max_new_tokens=STEPS, do_sample=False,
                             min_new_tokens=STEPS, output_logits=True, return_dict_in_generate=True)
    return out.sequences[:, ids.shape[1]:], torch.stack(out.logits, dim=1)


def test_the_global_layers_are_tiered_and_the_sliding_ones_keep_transformers_window_layer():
    cache = TieredCache(_model(), "full")
    kinds = [type(layer) for layer in cache.layers]
    assert kinds == [DynamicSlidingWindowLayer, DynamicSlidingWindowLayer, KVLayer] * 2
    assert [layer.layer_idx for layer in cache.tiered_layers] == [2, 5]
    assert all(layer.sliding_window == 16 for layer in cache.layers if isinstance(layer, DynamicSlidingWindowLayer))


@pytest.mark.parametrize("batch", [1, 2])
def test_full_decodes_as_transformers_does_past_the_window(batch: int):
    """A prompt five windows long, then decode steps: the sliding layers' window (a multi-token forward masks the
    rows 16 or more positions behind each query) and the global layers' tier, against transformers' DynamicCache.
    Batch 2 is left-padded (one sequence 7 tokens shorter)."""
    model = _model()
    ids = _ids(PROMPT, batch)
    mask = torch.ones_like(ids)
    if batch == 2:
        mask[1, :7] = 0
    ref_tokens, ref_logits = _greedy(model, ids, DynamicCache(config=model.config), mask)
    tokens, logits = _greedy(model, ids, TieredCache(model, "full"), mask)
    for b in range(batch):
        assert_same_greedy(ref_tokens[b], tokens[b], ref_logits[b], logits[b], atol=1e-4)


def test_a_prompt_prefilled_in_chunks_smaller_than_the_window_attends_as_one_forward():
    model = _model()
    ids = _ids(PROMPT)
    with torch.no_grad():
        ref = prefill(model, DynamicCache(config=model.config), ids, chunk_size=PROMPT)
        chunked = prefill(model, TieredCache(model, "full"), ids, chunk_size=11)
    assert (ref - chunked).abs().max().item() < 1e-4


@pytest.mark.parametrize("block", [7, 16, 1024])
def test_a_long_sliding_forward_attends_in_blocks_of_queries_over_the_rows_their_windows_reach(block, monkeypatch):
    """At 32k tokens a whole [q, n] window mask and SDPA's scores over it took ~20 GB (a real Gemma-3-270M trial was
    killed): the forward attends WINDOW_BLOCK queries at a time. Blocks smaller than, equal to and larger than the
    window give transformers' logits, with a left-padded batch."""
    from kvzoo.framework import attention

    monkeypatch.setattr(attention, "WINDOW_BLOCK", block)
    model = _model()
    ids = _ids(PROMPT, 2)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask, cache=DynamicCache(config=model.config)).logits
        got = model(input_ids=ids, attention_mask=mask, cache=TieredCache(model, "full")).logits
    assert (ref[0] - got[0]).abs().max().item() < 1e-4
    assert (ref[1, 5:] - got[1, 5:]).abs().max().item() < 1e-4  # the padding positions' own outputs are not compared


def test_stats_count_the_sliding_layers_apart_and_name_the_layers_the_figures_cover():
    model = _model()
    cache = TieredCache(model, "snapkv(budget=24, window=8)")
    with torch.no_grad():
        prefill(model, cache, _ids(PROMPT), ends_context=True)
        before = cache.stats().totals
        model(input_ids=_ids(1, seed=1), cache=cache, use_cache=True)
    stats = cache.stats()
    assert [u["layer"] for u in stats.untiered] == [0, 1, 3, 4]
    assert {u["kind"] for u in stats.untiered} == {"sliding window 16"}
    # a sliding layer holds its last 15 rows (window - 1) of 1 KV head x 32 dims, keys and values, fp32
    assert all(u["resident_rows"] == 15 and u["resident_bytes"] == 15 * 32 * 2 * 4 for u in stats.untiered)
    assert stats.totals["untiered_resident_bytes"] == 4 * 15 * 32 * 2 * 4
    # the decode step read each sliding layer's window (15 kept rows + the new one), beside the global layers' figure
    read = stats.totals["untiered_kv_bytes_read"] - before["untiered_kv_bytes_read"]
    assert read == 4 * 16 * 32 * 2 * 4
    assert [s.layer for s in stats.layers] == [2, 5] and stats.totals["resident_rows"] == 2 * (24 + 1)
    assert any("the 2 layers the policy acts on ([2, 5])" in note and "sliding window 16" in note
               for note in stats.notes)
    llama = TieredCache(tiny_llama()[0], "full").stats()
    assert llama.untiered == [] and "untiered_resident_bytes" not in llama.totals


def test_a_model_whose_every_layer_slides_or_of_unknown_layer_type_is_refused_naming_why():
    with pytest.raises(ValueError, match="sliding window in every layer: there is no global layer"):
        TieredCache(tiny_gemma3(layer_types=["sliding_attention"] * 6)[0], "full")
    model = tiny_gemma3()[0]
    model.config.layer_types = ["sliding_attention", "chunked_attention"] * 3
    with pytest.raises(ValueError, match=r"layer types \['chunked_attention'\].*'full_attention' \(tiered\)"):
        TieredCache(model, "full")


@pytest.mark.gemma3
def test_full_decodes_as_transformers_does_on_the_real_gemma3_270m_at_2k(gemma3_270m):
    """2,000 tokens of Paul Graham's essays (four sliding windows of 512), then greedy decoding: kvzoo's `full` (the
    global layers tiered, the sliding ones in transformers' window layer) against transformers' DynamicCache."""
    import itertools

    from kvzoo.haystacks import paul_graham_sentences

    model, tokenizer = gemma3_270m
    assert [i for i, t in enumerate(model.config.layer_types) if t == "full_attention"] == [5, 11, 17]
    text = " ".join(itertools.islice(paul_graham_sentences(0), 200))
    ids = tokenizer(text, return_tensors="pt").input_ids[:, :2000]
    assert ids.shape[1] == 2000
    ref_tokens, ref_logits = _greedy(model, ids, DynamicCache(config=model.config))
    cache = TieredCache(model, "full")
    tokens, logits = _greedy(model, ids, cache)
    assert_same_greedy(ref_tokens[0], tokens[0], ref_logits[0], logits[0], atol=1e-3)
    assert [u["resident_rows"] for u in cache.stats().untiered] == [511] * 15  # window - 1 rows each
