"""Caches made from a cache: a fork (the same rows, counters and policy, its tensors copied), and a cache that
continues another's prefill under a new policy (``TieredCache.fork_as`` and ``transplant``), with the rules for when a
prefill may be shared (:func:`dense_prefill_problem`). The constructors are ``TieredCache``'s methods; the work they
share is here."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

from kvzoo.framework.names import policy_retriever
from kvzoo.framework.policy import Policy
from kvzoo.framework.retrieval import Retrieval
from kvzoo.framework.runtime import Runtime, RuntimeConfig


def retriever_of(policy: Policy):
    """``policy``'s retriever (or None); a ValueError when it has one but keeps no archive to fetch from."""
    retriever = policy_retriever(policy)
    if retriever is not None and not policy.archive:
        raise ValueError(
            f"policy {policy.name!r} has retriever={retriever.name!r} but archive=False: a retriever "
            "fetches from the archive; use archive=True or retriever=None"
        )
    return retriever


def dense_prefill_problem(policy: Policy, *, one_forward: int | None = None,
                          attention_recorded: bool = False) -> str | None:
    """Why ``policy``'s prefill is not a plain dense prefill another policy could share (None: it is): it
    accumulates attention or records inputs there, prefills token by token, or acts during the prefill.

    ``one_forward``: the context's length, when ``policy``'s own prefill of it would be one forward ending the
    context: a ``step`` or ``block`` policy then acts only after it, layer by layer, on dense rows (what
    ``fork_as(..., ends_context=True)`` replays), unless its blocks are shorter than the context.
    ``attention_recorded``: the shared prefill accumulated each row's attention, so H2O can share it."""
    observed = policy.observes & ({"inputs"} if attention_recorded else {"accumulate", "inputs"})
    if observed:
        return f"{policy.name!r} observes {sorted(observed)} during the prefill"
    if policy.multi_token_window(1 << 30) is not None:
        return f"{policy.name!r} prefills with a window (token by token), not densely"
    if policy.schedule == "context_end":
        return None
    if one_forward is None:
        return f"{policy.name!r} acts during the prefill (schedule {policy.schedule!r})"
    block = policy.block_size if policy.schedule == "block" else None
    if block and one_forward > block:
        return (f"{policy.name!r} prefills in blocks of {block} rows and the context has {one_forward}: each block "
                "after the first attends to the rows the earlier ones kept, not to a dense prefill")
    return None


def compressed(cache: Any) -> bool:
    """Whether an event has fired on any of ``cache``'s layers (its rows are no longer a prefill's)."""
    return any(la.context_ended or la.store.budget is not None or la.store.archive.positions.n or la.counts.events
               for la in cache.tiered_layers)


def clone(cache: Any, runtime: Runtime, *, shared: bool) -> Any:
    """A cache on ``cache``'s model and adapter whose layers are deep copies of its own (tensors, counters),
    running with ``runtime`` (``shared``: with a copy of the policy's cross-layer scratch). The configuration
    objects the layers point to -- the policy, the retrieval tier, its retriever -- are shared, not copied."""
    old = cache.runtime
    memo = {id(obj): obj for obj in (old.policy, old.retrieval, old.retriever) if obj is not None}
    memo[id(old)] = runtime
    try:
        if shared:
            runtime.shared = copy.deepcopy(old.shared, memo)
        layers = copy.deepcopy(cache.layers, memo)
    except RuntimeError as err:
        if "graph leaves" not in str(err):
            raise
        raise RuntimeError(
            "TieredCache.fork(): this cache holds tensors of an autograd graph -- it was filled with gradients "
            "enabled (model(ids, cache=cache) outside torch.no_grad()) -- and such tensors cannot be copied. A "
            "cache needs no graph: fill it under torch.no_grad() (or torch.inference_mode()), then fork it"
        ) from None
    new = copy.copy(cache)  # the Cache's own settings, the adapter: shared
    new.runtime, new.graph, new.layers = runtime, None, layers
    new.untiered_read = dict(cache.untiered_read)
    runtime.resident = runtime.peak_resident = sum(layer.store.n for layer in new.tiered_layers if layer.is_initialized)
    return new


def prefill_problem(cache: Any, policy: Policy, *, ends_context: bool = False, one_forward: bool = False) -> str | None:
    """Why a fork of ``cache`` cannot continue as ``policy`` (``TieredCache.fork_as``); None when it can: no event
    has fired, both policies would have prefilled the same dense rows (:func:`dense_prefill_problem`), and the
    queries kept cover ``policy``'s observation window."""
    if compressed(cache):
        return "this cache has compressed already (an event fired)"
    problem = dense_prefill_problem(cache.policy)
    if problem is not None:
        return f"this cache's policy {problem}"
    rows = max((la.counts.seen for la in cache.tiered_layers), default=0)
    recorded = cache.runtime.config.record_attention
    problem = dense_prefill_problem(policy, one_forward=rows if ends_context or one_forward else None,
                                    attention_recorded=recorded)
    if problem is not None:
        hint = (" (create this cache with record_attention=True)"
                if "accumulate" in policy.observes and not recorded else "")
        return f"the new policy {problem}{hint}"
    if recorded and "accumulate" not in policy.observes:
        return (f"this cache recorded each row's attention (record_attention=True) through the reference attention, "
                f"not the fused one policy {policy.name!r} prefills with: its rows differ in rounding")
    layout = cache.adapter.geometry.layout
    if layout not in policy.layouts:
        return f"policy {policy.name!r} supports layouts {policy.layouts}, this model is {layout!r}"
    needed = policy.observation_window if "window" in policy.observes else 0
    if needed > cache.runtime.observation_window:
        return (f"policy {policy.name!r} reads the last {needed} queries, this cache kept "
                f"{cache.runtime.observation_window} (create it with record_window={needed})")
    return None


def continue_as(cache: Any, policy: Policy, *, capacity: int | None = None, context_length: int | None = None) -> Any:
    """``cache``'s rows, counters and kept queries (cut to ``policy``'s window), continued by ``policy`` with a
    runtime of its own (its retriever with an empty index)."""
    retriever = retriever_of(policy)
    old = cache.runtime
    retrieval = Retrieval(retriever, audit=old.audit) if retriever is not None else None
    geometry = old.geometry if capacity is None else dataclasses.replace(old.geometry, capacity=capacity)
    runtime = Runtime(RuntimeConfig(policy, retrieval, geometry, old.num_layers, old.record_window),  # attention: the policy's
                      context_length=context_length or old.context_length)
    new = clone(cache, runtime, shared=False)
    window = runtime.observation_window
    for layer in new.tiered_layers:
        layer.continue_as(capacity=capacity)
        queries = layer.observed.queries
        if queries is not None:
            layer.observed.queries = queries[:, :, -window:].clone() if window > 0 else None
    return new
