"""A prompt prefilled in chunks keeps the rows one forward keeps (issue 44, item 1): for every registered policy on
the three model families, chunks of 1, 2, 5 and 16 tokens through ``kvzoo.pipeline.prefill`` end the context at the
prompt's end, not at its first single-token chunk (``auto_compress`` takes a one-token forward after rows for
``generate``'s first decode step only outside a prefill)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvzoo import TieredCache, pipeline, registry
from kvzoo.framework.attention import detach

from .conftest import model

FAMILIES = ("llama", "deepseek_v2", "kimi_linear")
PROMPT, BUDGET = 40, 16
CHUNKS = (1, 2, 5, 16)


def _policy(name: str):
    """``name`` at test sizes: a budget that compresses the prompt, a window and sinks that fit in it, blocks shorter
    than the prompt, every layer compressed."""
    cls = registry.policy_class(name)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    params = {"budget": BUDGET} if cls.requires_budget else {}
    if "window" in fields:
        params["window"] = 4
    if "block_size" in fields and cls.schedule == "block":  # a budget per block: two blocks close, 8 rows stay open
        params.update(block_size=16, budget=BUDGET // 2)
    if "dense_layers" in fields:
        params["dense_layers"] = 0
    if "page_size" in fields:
        params["page_size"] = 4
    return registry.get(name, **params)


def _kept(family: str, name: str, chunk: int | None) -> list[torch.Tensor]:
    """Each tiered layer's kept positions (sorted) after ``pipeline.prefill(..., ends_context=True)`` in chunks of
    ``chunk`` tokens (None: one forward)."""
    m = model(family)
    ids = torch.randint(3, m.config.vocab_size, (1, PROMPT), generator=torch.Generator().manual_seed(7))
    detach(m)
    cache = TieredCache(m, _policy(name), context_length=PROMPT)
    try:
        pipeline.prefill(m, cache, ids, chunk or PROMPT, ends_context=True)
        pipeline.compress(cache)
        return [layer.slots.sort(dim=-1).values for layer in cache.tiered_layers]
    finally:
        cache.close()
        detach(m)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("name", list(registry.available()))
def test_a_chunked_prefill_keeps_the_rows_one_forward_keeps(name, family):
    if family != "llama" and "mla" not in registry.policy_class(name).layouts:
        pytest.skip(f"{name} does not run on MLA models")
    whole = _kept(family, name, None)
    assert any(kept.shape[-1] < PROMPT for kept in whole) or not registry.policy_class(name).requires_budget, \
        "the budget must compress the prompt for the comparison to mean something"
    for chunk in CHUNKS:
        got = _kept(family, name, chunk)
        for i, (a, b) in enumerate(zip(whole, got, strict=True)):
            assert torch.equal(a, b), f"chunks of {chunk}, tiered layer {i}: kept {b.tolist()}, one forward {a.tolist()}"
