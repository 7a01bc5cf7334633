"""kvzoo and kvpress in kvpress's own environment (``make test-kvpress``: .venv-kvpress, transformers < 5.3).

Which rows a press kept is read from kvpress's cache: each kept key is found again among the keys of
an uncompressed run of the same model on the same ids (a random projection of a row identifies it;
keys are bit-identical between the two runs). Which rows kvzoo kept is read from ``TieredCache``'s slots.
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
from kvzoo.bench.haystacks import book_text_sentences  # noqa: E402
from kvzoo.framework.cache import TieredCache  # noqa: E402
from kvzoo.framework.policy import Policy  # noqa: E402


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


def rows_of(kept_keys: torch.Tensor, all_keys: torch.Tensor) -> torch.Tensor:
    """Sorted positions ``[B, G, k]`` in ``all_keys [B, G, n, D]`` of the rows ``kept_keys [B, G, k, D]``."""
    proj = torch.randn(all_keys.shape[-1], dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    every, kept = all_keys.double() @ proj, kept_keys.double() @ proj  # one number per row
    ordered, order = every.sort(dim=-1)
    at = torch.searchsorted(ordered.contiguous(), kept.contiguous()).clamp(max=every.shape[-1] - 1)
    assert torch.equal(ordered.gather(-1, at), kept), "a kept key is not a key of the uncompressed run"
    return order.gather(-1, at).sort(dim=-1).values


@torch.no_grad()
def kvzoo_rows(model: torch.nn.Module, ids: torch.Tensor, policy: Policy | str) -> list[torch.Tensor]:
    """Slots ``[B, G, k]`` each layer keeps in kvzoo's runtime after prefilling ``ids`` and compressing."""
    cache = TieredCache(model, policy, context_length=ids.shape[1])
    pipeline.prefill(model, cache, ids)
    pipeline.compress(cache)
    return [layer.slots for layer in cache.tiered_layers]


class Reference:
    """Uncompressed keys per (model, ids), computed once."""

    def __init__(self) -> None:
        self.keys: dict[tuple[int, int], list[torch.Tensor]] = {}

    def __call__(self, model: torch.nn.Module, ids: torch.Tensor) -> list[torch.Tensor]:
        key = (id(model), id(ids))
        if key not in self.keys:
            self.keys[key] = [layer.keys for layer in kvpress_cache(model, ids).layers]
        return self.keys[key]


@pytest.fixture(scope="session")
def kv() -> SimpleNamespace:
    """Helpers: ``kv.press_rows(model, ids, press)`` and ``kv.zoo_rows(model, ids, policy)``, per layer."""
    reference = Reference()

    def press_rows(model: torch.nn.Module, ids: torch.Tensor, press) -> list[torch.Tensor]:
        cache = kvpress_cache(model, ids, press)
        return [rows_of(layer.keys, full) for layer, full in zip(cache.layers, reference(model, ids))]

    return SimpleNamespace(press_rows=press_rows, zoo_rows=kvzoo_rows, cache=kvpress_cache)


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
