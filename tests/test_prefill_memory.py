"""What keeps a long prefill's memory down besides compressing inside the forward: the feed-forward in pieces of
tokens (``kvzoo.pipeline.feed_forward_in_pieces``, on by default in ``pipeline.prefill``) and the freed pages given
back after each layer compresses (``kvzoo.framework.memory.release_freed``). Toy sizes: the memory itself is measured
by ``benchmarks/prefill_peak.py`` and ``benchmarks/kvpress_side_by_side.py``."""

from __future__ import annotations

import functools

import pytest
import torch

from kvzoo import TieredCache, pipeline, registry
from kvzoo.framework import memory
from kvzoo.framework.attention import detach
from kvzoo.models import TINY_FAMILIES

PROMPT = 80


@functools.cache
def _model(family: str):
    model = TINY_FAMILIES[family]()[0]
    detach(model)
    return model


def _prefill(model, rows: int | None, policy: str = "snapkv"):
    ids = torch.randint(3, model.config.vocab_size, (1, PROMPT), generator=torch.Generator().manual_seed(1))
    cache = TieredCache(model, registry.get(policy, budget=24, window=8), context_length=PROMPT)
    logits = pipeline.prefill(model, cache, ids, ends_context=True, feed_forward_rows=rows)
    kept = [layer.slots.sort(dim=-1).values for layer in cache.tiered_layers]
    tokens = pipeline.greedy_decode(model, cache, logits, 4, set())
    detach(model)
    return logits, kept, tokens


@pytest.mark.parametrize("family", list(TINY_FAMILIES))
def test_the_feed_forward_in_pieces_keeps_the_rows_and_tokens_of_the_whole_forward(family):
    model = _model(family)
    whole = _prefill(model, None)
    pieces = _prefill(model, 16)  # 80 tokens: five pieces per layer, dense MLPs and mixtures of experts alike
    torch.testing.assert_close(pieces[0], whole[0], rtol=1e-5, atol=1e-5)
    for layer, (a, b) in enumerate(zip(whole[1], pieces[1])):
        assert torch.equal(a, b), f"layer {layer}: other rows kept"
    assert pieces[2] == whole[2]
    assert not any("forward" in vars(layer.mlp) for layer in pipeline._decoder_layers(model)), "wrapper left behind"


def test_the_pieces_cover_every_token_once_and_are_restored_after_an_error():
    model = _model("llama")
    mlp = model.model.layers[0].mlp
    hidden = torch.randn(2, 37, model.config.hidden_size)
    with torch.no_grad():
        whole = mlp(hidden)
        with pipeline.feed_forward_in_pieces(model, 8) as wrapped:
            assert wrapped == model.config.num_hidden_layers
            torch.testing.assert_close(mlp(hidden), whole, rtol=1e-6, atol=1e-6)
            assert mlp(hidden[:, :8]).shape == (2, 8, model.config.hidden_size)  # one piece: called as it is
        with pytest.raises(RuntimeError, match="boom"), pipeline.feed_forward_in_pieces(model, 8):
            raise RuntimeError("boom")
    assert "forward" not in vars(mlp)


def test_a_feed_forward_that_is_not_token_wise_is_refused_by_name():
    def pooled(hidden):  # one vector per sequence: cannot be split by tokens
        return hidden.mean(dim=-2, keepdim=True)

    with pytest.raises(TypeError, match="feed_forward_rows=0"):
        pipeline._feed_forward_in_pieces(pooled, 4, torch.randn(1, 10, 3))


@pytest.mark.parametrize("bad", [-1, 1.5, True, "64"])
def test_a_bad_feed_forward_rows_is_refused(bad):
    model = _model("llama")
    cache = TieredCache(model, "full")
    with pytest.raises(ValueError, match="feed_forward_rows must be"):
        pipeline.prefill(model, cache, torch.tensor([[5, 6, 7]]), feed_forward_rows=bad)


@pytest.fixture
def freed(monkeypatch):
    """The bytes each context-ending layer hands to ``release_freed`` (which then gives nothing back)."""
    import kvzoo.framework.attention as attention

    calls: list[int] = []
    monkeypatch.setattr(attention, "release_freed", lambda n: calls.append(n) or True)
    return calls


def _rows_bytes(layer, rows: int) -> int:
    """Bytes of ``rows`` rows of every (sequence, group) of ``layer``."""
    batch, groups = layer.store.batch_groups
    return rows * layer.store.row_bytes() * batch * groups


def test_a_layer_that_dropped_its_prefill_gives_the_pages_back_in_a_context_ending_forward(freed):
    model = _model("llama")
    ids = torch.randint(3, model.config.vocab_size, (1, PROMPT), generator=torch.Generator().manual_seed(2))
    cache = TieredCache(model, registry.get("snapkv", budget=24, window=8), context_length=PROMPT)
    pipeline.prefill(model, cache, ids[:, :40])  # not the context's end: nothing compressed, nothing given back
    assert freed == []
    pipeline.prefill(model, cache, ids[:, 40:], ends_context=True)
    assert freed == [_rows_bytes(cache.tiered_layers[0], PROMPT - 24)] * len(cache.tiered_layers)
    detach(model)


def test_a_context_ending_forward_counts_the_rows_it_brought_when_it_dropped_fewer(freed):
    # the layer's activations scale with the rows the forward brought, not with those dropped: a policy keeping most
    # rows still has its layers' freed activations given back (docs: kvzoo/framework/memory.py)
    model = _model("llama")
    ids = torch.randint(3, model.config.vocab_size, (1, PROMPT), generator=torch.Generator().manual_seed(3))
    cache = TieredCache(model, registry.get("snapkv", budget=72, window=8), context_length=PROMPT)
    pipeline.prefill(model, cache, ids, ends_context=True)  # one forward: 80 rows brought, 8 dropped
    layer = cache.tiered_layers[0]
    assert layer.store.n == 72
    assert freed == [_rows_bytes(layer, PROMPT)] * len(cache.tiered_layers)
    detach(model)


def test_release_freed_can_be_turned_off_and_skips_small_frees(monkeypatch):
    trims = []
    monkeypatch.setattr(memory, "_malloc_trim", lambda: trims.append)
    monkeypatch.setenv(memory.VARIABLE, "0")
    assert memory.can_release() is False and memory.release_freed() is False
    monkeypatch.delenv(memory.VARIABLE)
    assert memory.release_freed(memory.TRIM_AFTER - 1) is False  # too little freed to be worth the faults
    assert memory.release_freed(memory.TRIM_AFTER) is True and memory.release_freed() is True
    assert trims == [0, 0]
