"""``TieredCache(..., capacity=N)`` changes how storage is laid out, never what a policy computes: for every
registered policy (and quest's and vestige's retrievers under other selectors), any prompt length, any prefill chunk
size and any capacity -- below, at or above the prompt -- the greedy tokens and the rows kept are those of the same
cache without ``capacity`` (up to a near tie), or the cache refuses at construction with a clear error."""

from __future__ import annotations

import functools
import os

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from kvzoo import TieredCache, registry
from kvzoo.framework.attention import detach
from kvzoo.models import tiny_deepseek_v2, tiny_llama
from tests.greedy import assert_same_greedy

STEPS = 6


# A retriever's choice compares floats that two numerical routes (storage laid out for `capacity`, or grown) compute a
# rounding apart -- s* against a bound, the j-th estimate against the (j+1)-th --, and a row at such a near tie flips,
# which changes the logits by far more than rounding while both runs are right. The retriever variants here fetch every
# archived row the prompts can have (j and pages above any count here): what is compared is where rows are stored and
# read, not a tie.
TIE_FREE = {"retriever": registry.build_retriever("vestige", j=128, j_margin=1e6)}


def _variants() -> list[tuple[str, dict]]:
    """Every registered policy at a budget a short prompt exceeds, and the retrievers under other selectors."""
    out = []
    for name in registry.available():
        cls = registry.policy_class(name)
        params = {} if not getattr(cls, "requires_budget", True) else {"ratio": 2}
        if "window" in cls.__dataclass_fields__:  # an observation window the short prompts' budgets hold
            params["window"] = 4
        if name == "vestige":
            params.update(TIE_FREE)
            out.append((name, {**params, "block_size": 24}))  # blocks close inside the prompt and the decode
        if name == "quest":
            params.update(dense_layers=0, retriever=registry.build_retriever("quest", pages=64))
        out.append((name, params))
    out += [("snapkv", {"ratio": 2, "window": 4, **TIE_FREE}), ("streaming_llm", {"ratio": 2, "retriever": registry.build_retriever("quest", pages=64)}),
            ("h2o", {"ratio": 2, **TIE_FREE})]
    return out


VARIANTS = _variants()


@functools.cache
def _model(family: str):
    model = {"llama": tiny_llama, "deepseek_v2": tiny_deepseek_v2}[family]()[0]
    detach(model)
    return model


def _decode(model, policy, ids: torch.Tensor, chunk: int, capacity: int | None):
    """Prefill ``ids`` in chunks, compress, then ``STEPS`` greedy steps: (tokens, logits, kept slots per layer)."""
    cache = TieredCache(model, policy, capacity=capacity, context_length=ids.shape[1])
    n = ids.shape[1]
    with torch.no_grad():
        for start in range(0, n, chunk):
            logits = model(input_ids=ids[:, start : start + chunk], cache=cache, use_cache=True).logits[:, -1]
        cache.compress()
        tokens, seen = [], []
        for t in range(STEPS):
            token = logits.argmax(-1, keepdim=True)
            tokens.append(token[0, 0])
            seen.append(logits[0])
            logits = model(input_ids=token, position_ids=torch.tensor([[n + t]]), cache=cache,
                           use_cache=True).logits[:, -1]
    kept = [layer.slots.sort(dim=-1).values for layer in cache.tiered_layers]
    detach(model)
    return torch.stack(tokens), torch.stack(seen), kept


# no shrinking: a failing example is printed as drawn (shrinking a decode run takes minutes)
@settings(max_examples=int(os.environ.get("KVZOO_CAPACITY_EXAMPLES", 60)), deadline=None,
          suppress_health_check=[HealthCheck.too_slow],
          phases=[Phase.explicit, Phase.reuse, Phase.generate])
@given(family=st.sampled_from(["llama", "deepseek_v2"]), variant=st.sampled_from(VARIANTS),
       prompt=st.integers(24, 70), chunk_fraction=st.floats(0.0, 1.2), where=st.sampled_from(["below", "at", "above"]),
       seed=st.integers(0, 2**16))
def test_capacity_changes_no_token_and_no_kept_row(family, variant, prompt, chunk_fraction, where, seed):
    name, params = variant
    model = _model(family)
    policy = registry.get(name, **params)
    if ("mla" if family != "llama" else "gqa") not in policy.layouts:
        return
    ids = torch.randint(3, model.config.vocab_size, (1, prompt), generator=torch.Generator().manual_seed(seed))
    chunk = max(1, int(chunk_fraction * prompt))  # 1 token at a time up to past the whole prompt
    capacity = {"below": max(1, prompt // 2), "at": prompt, "above": prompt + STEPS + 3}[where]
    ref_tokens, ref_logits, ref_kept = _decode(model, policy, ids, chunk, None)
    tokens, logits, kept = _decode(model, registry.get(name, **params), ids, chunk, capacity)
    assert_same_greedy(ref_tokens, tokens, ref_logits, logits)
    if torch.equal(ref_tokens, tokens):
        for layer, (a, b) in enumerate(zip(ref_kept, kept)):
            assert torch.equal(a, b), f"{name} {params}: layer {layer} keeps other rows with capacity={capacity}"


def test_a_capacity_beyond_the_models_positions_is_refused_naming_the_limit():
    model = _model("llama")
    limit = model.config.max_position_embeddings
    with pytest.raises(ValueError, match=f"max_position_embeddings={limit}"):
        TieredCache(model, "full", capacity=limit + 1)
    TieredCache(model, "full", capacity=limit)  # at the limit: fine
