"""kvzoo and kvpress in kvpress's environment (``make test-kvpress``: .venv-kvpress, transformers < 5.3).

Which rows a press kept is read inside kvpress's hook: a wrapper around the press's ``compress`` sees the
layer's uncompressed keys (in position order) and the keys the press returns, and each returned key is found
among that same call's input keys. A press selects by gathering, so a kept key is a bit-for-bit copy of an input
key *of the same call*; keys of a separate uncompressed run are not (on some machines they round differently:
the assumption that they are made these tests fail). Which rows kvzoo kept is read from ``TieredCache``'s slots.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from types import SimpleNamespace

import pytest
import torch

if os.environ.get("KVZOO_KVPRESS_TESTS") != "1":
    raise pytest.UsageError("tests/kvpress runs in kvpress's environment: `make test-kvpress` (it sets KVZOO_KVPRESS_TESTS=1)")

try:
    import kvpress  # noqa: F401
except ImportError as err:  # said loudly: these tests exist to run with kvpress
    from kvzoo.integrations.kvpress import KVPRESS_INSTALL

    raise pytest.UsageError(f"tests/kvpress needs kvpress, which is not importable here ({err}). {KVPRESS_INSTALL}") from err

from transformers import DynamicCache  # noqa: E402

from kvzoo import pipeline  # noqa: E402
from kvzoo.framework.cache import TieredCache  # noqa: E402
from kvzoo.framework.policy import Policy  # noqa: E402
from kvzoo.haystacks import book_text_sentences  # noqa: E402


@torch.no_grad()
def kvpress_cache(model: torch.nn.Module, ids: torch.Tensor, press=None) -> DynamicCache:
    """The prefill of ``ids`` as kvpress's pipeline runs it: ``model.model`` under ``press(model)``."""
    cache = DynamicCache()
    if press is None:
        model.model(input_ids=ids, past_key_values=cache)
        return cache
    with press(model):
        model.model(input_ids=ids, past_key_values=cache)
    return cache


_BITS = {4: torch.int32, 2: torch.int16, 8: torch.int64}


def row_ids(keys: torch.Tensor) -> torch.Tensor:
    """One int64 per row of ``keys [..., D]``, computed from the rows' bits in integer arithmetic.

    Exact by construction: integer sums are associative (int64 wraps around), so the number does not depend on
    the memory layout, the batch the row sits in or the order of the sum -- unlike a floating projection
    ``keys @ proj``, whose rounding changes with the shape and strides of ``keys`` (what made these tests fail).
    """
    bits = keys.contiguous().view(_BITS[keys.element_size()]).long()
    weights = torch.randint(1, 2**31 - 1, (keys.shape[-1],), generator=torch.Generator().manual_seed(0))
    return (bits * weights).sum(dim=-1)


def rows_of(kept_keys: torch.Tensor, all_keys: torch.Tensor) -> torch.Tensor:
    """Sorted positions ``[B, G, k]`` in ``all_keys [B, G, n, D]`` of the rows ``kept_keys [B, G, k, D]``.

    ``kept_keys`` must be copies of rows of ``all_keys`` (what a press's gather returns). Rows are matched by
    :func:`row_ids` (exact, from the bits); every input row's number must be unique, so a match is unambiguous.
    """
    every, kept = row_ids(all_keys), row_ids(kept_keys)
    ordered, order = every.sort(dim=-1)
    assert (ordered.diff(dim=-1) != 0).all(), "two input rows have the same bits: the match would be ambiguous"
    at = torch.searchsorted(ordered.contiguous(), kept.contiguous()).clamp(max=every.shape[-1] - 1)
    assert torch.equal(ordered.gather(-1, at), kept), "a kept key is not a copy of one of the layer's input keys"
    return order.gather(-1, at).sort(dim=-1).values


@torch.no_grad()
def press_rows(model: torch.nn.Module, ids: torch.Tensor, press,
               inputs: dict[int, torch.Tensor] | None = None) -> list[torch.Tensor]:
    """Positions ``[B, G, k]`` per layer of the rows ``press`` keeps, read inside kvpress's hook.

    The press's own ``compress`` is wrapped for the call (an instance attribute: kvpress's hook calls
    ``self.compress``), so the positions come from the very keys the press compressed; ``inputs``, if given,
    receives those keys per layer (``[B, G, n, D]``, in position order).
    """
    kept: dict[int, torch.Tensor] = {}
    compress = press.compress

    def recording(module, hidden_states, keys, values, attentions, kwargs):
        out_keys, out_values = compress(module, hidden_states, keys, values, attentions, kwargs)
        kept[module.layer_idx] = rows_of(out_keys, keys)
        if inputs is not None:
            inputs[module.layer_idx] = keys.clone()
        return out_keys, out_values

    press.compress = recording
    try:
        cache = kvpress_cache(model, ids, press)
    finally:
        del press.compress
    assert sorted(kept) == list(range(len(cache.layers))), f"the press compressed layers {sorted(kept)} only"
    for layer, rows in kept.items():
        assert rows.shape[2] == cache.layers[layer].keys.shape[2], f"layer {layer}: the cache holds other rows"
    return [kept[layer] for layer in range(len(cache.layers))]


@torch.no_grad()
def kvzoo_rows(model: torch.nn.Module, ids: torch.Tensor, policy: Policy | str) -> list[torch.Tensor]:
    """Slots ``[B, G, k]`` each layer keeps in kvzoo's runtime after prefilling ``ids`` and compressing."""
    cache = TieredCache(model, policy, context_length=ids.shape[1])
    pipeline.prefill(model, cache, ids)
    pipeline.compress(cache)
    return [layer.slots for layer in cache.tiered_layers]


@torch.no_grad()
def press_decode_rows(model: torch.nn.Module, ids: torch.Tensor, steps: torch.Tensor, prefill_press, decoding_press,
                      position_order: bool = False) -> SimpleNamespace:
    """What kvpress's cache holds after prefilling ``ids [1, n]`` under ``PrefillDecodingPress(prefill_press,
    decoding_press)`` and then one decode step per token of ``steps [1, m]`` (teacher-forced, at positions
    ``n .. n + m - 1``, as kvpress's pipeline passes ``position_ids``). Returns ``rows``: sorted positions
    ``[B, G, k]`` per layer; ``dropped``: per layer, how many of the decoding press's ``compress`` calls dropped rows;
    ``scrambled``: whether some call returned its rows out of position order.

    Both presses' ``compress`` are wrapped, as in :func:`press_rows`: each call's kept keys are found among that
    call's input keys, and the positions of the input rows are carried from call to call (a decoding call's input is
    the rows kept at the layer's last call, in cache order, then the rows of the steps since, in order).

    kvpress 0.5.5's ``ScorerPress.compress`` gathers the kept rows in ``topk`` order, not in position order (NVIDIA/
    kvpress#173), and a scorer that ranks by cache index (``StreamingLLMPress``: the rows after the sinks, by index,
    are the oldest) then prunes other rows at the next compression. ``position_order=True`` puts each call's kept rows
    back in position order (keys and values alike) before the cache stores them: kvpress with that order kept."""
    n_layers = model.config.num_hidden_layers
    held: dict[int, torch.Tensor] = {}  # layer -> positions [B, G, k] of the rows the cache holds, in cache order
    dropped = [0] * n_layers
    scrambled = [False]
    pending: list[list[int]] = [[] for _ in range(n_layers)]  # per layer: decode steps' positions since its last call

    def wrap(press, decoding: bool):
        compress = press.compress

        def recording(module, hidden_states, keys, values, attentions, kwargs):
            out_keys, out_values = compress(module, hidden_states, keys, values, attentions, kwargs)
            layer = module.layer_idx
            B, G, n, _ = keys.shape
            if decoding:
                new = torch.tensor(pending[layer], dtype=torch.long).expand(B, G, -1)
                before = torch.cat([held[layer], new], dim=-1)
                pending[layer] = []
                assert before.shape[-1] == n, f"layer {layer}: the cache holds {n} rows, the record {before.shape[-1]}"
                dropped[layer] += int(out_keys.shape[2] < n)
            else:
                before = torch.arange(n).expand(B, G, n)
            kept = before.gather(-1, rows_of_in_order(out_keys, keys))
            order = kept.argsort(dim=-1)
            scrambled[0] |= not torch.equal(order, torch.arange(kept.shape[-1]).expand_as(order))
            if position_order:
                at = order[..., None].expand_as(out_keys)
                out_keys, out_values, kept = out_keys.gather(2, at), out_values.gather(2, at), kept.gather(-1, order)
            held[layer] = kept
            return out_keys, out_values

        press.compress = recording
        return press

    import kvpress

    press = kvpress.PrefillDecodingPress(prefilling_press=wrap(prefill_press, False),
                                         decoding_press=wrap(decoding_press, True))
    cache = DynamicCache()
    n = ids.shape[1]
    try:
        with press(model):
            model.model(input_ids=ids, past_key_values=cache)
            assert sorted(held) == list(range(n_layers)), "the prefill press did not compress every layer"
            for i in range(steps.shape[1]):
                for rows in pending:
                    rows.append(n + i)
                model.model(input_ids=steps[:, i : i + 1], past_key_values=cache, position_ids=torch.tensor([[n + i]]))
    finally:
        del prefill_press.compress, decoding_press.compress
    for layer in range(n_layers):  # the rows appended since the layer's last compression
        since = torch.tensor(pending[layer], dtype=torch.long).expand(*held[layer].shape[:2], -1)
        held[layer] = torch.cat([held[layer], since], dim=-1)
        assert held[layer].shape[-1] == cache.layers[layer].keys.shape[2], f"layer {layer}: the cache holds other rows"
    return SimpleNamespace(rows=[held[layer].sort(dim=-1).values for layer in range(n_layers)], dropped=dropped,
                           scrambled=scrambled[0])


def rows_of_in_order(kept_keys: torch.Tensor, all_keys: torch.Tensor) -> torch.Tensor:
    """Indices ``[B, G, k]`` in ``all_keys`` of the rows ``kept_keys``, in ``kept_keys``'s order (the order the cache
    holds them), matched by :func:`row_ids` as in :func:`rows_of`."""
    every, kept = row_ids(all_keys), row_ids(kept_keys)
    ordered, order = every.sort(dim=-1)
    assert (ordered.diff(dim=-1) != 0).all(), "two input rows have the same bits: the match would be ambiguous"
    at = torch.searchsorted(ordered.contiguous(), kept.contiguous()).clamp(max=every.shape[-1] - 1)
    assert torch.equal(ordered.gather(-1, at), kept), "a kept key is not a copy of one of the layer's input keys"
    return order.gather(-1, at)


@torch.no_grad()
def kvzoo_decode_rows(model: torch.nn.Module, ids: torch.Tensor, steps: torch.Tensor,
                      policy: Policy | str) -> list[torch.Tensor]:
    """Slots ``[B, G, k]`` each layer holds in kvzoo's runtime after prefilling ``ids``, compressing, and one decode
    step per token of ``steps [1, m]`` (teacher-forced)."""
    cache = TieredCache(model, policy, context_length=ids.shape[1])
    pipeline.prefill(model, cache, ids)
    pipeline.compress(cache)
    for i in range(steps.shape[1]):
        model(input_ids=steps[:, i : i + 1], **pipeline.cache_kwargs(model, cache), use_cache=True, logits_to_keep=1)
    return [layer.slots.sort(dim=-1).values for layer in cache.tiered_layers]


@pytest.fixture(scope="session")
def kv() -> SimpleNamespace:
    """Helpers: ``kv.press_rows(model, ids, press)`` and ``kv.zoo_rows(model, ids, policy)``, per layer; after decode
    steps, ``kv.press_decode_rows(model, ids, steps, prefill_press, decoding_press)`` and
    ``kv.zoo_decode_rows(model, ids, steps, policy)``."""
    return SimpleNamespace(press_rows=press_rows, zoo_rows=kvzoo_rows, cache=kvpress_cache,
                           press_decode_rows=press_decode_rows, zoo_decode_rows=kvzoo_decode_rows)


@pytest.fixture(scope="session")
def smol():
    """SmolLM2-135M-Instruct (real weights), fp32."""
    from kvzoo.models import load_smollm2

    return load_smollm2(torch.float32)


def _book_ids(tokenizer, n: int) -> torch.Tensor:
    text = " ".join(book_text_sentences())
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids[:, :n]
    assert ids.shape[1] == n, f"the book text has {ids.shape[1]} tokens, fewer than {n}"
    return ids


@pytest.fixture(scope="session")
def smol_ids(smol) -> torch.Tensor:
    """2,000 tokens of public-domain text (a multiple of ChunkKVPress's 20: whole chunks)."""
    return _book_ids(smol[1], 2000)


@pytest.fixture(scope="session")
def tiny_ids() -> torch.Tensor:
    return torch.randint(0, 256, (1, 400), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="session")
def book_ids() -> Callable[[object, int], torch.Tensor]:
    return _book_ids
