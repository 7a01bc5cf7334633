"""One decode step of one attention layer, top to bottom.

The cache's ``update`` has appended the step's row to the attended tier before the attention runs (an event
fired there if the prompt just ended: ``model.generate``'s first decode step). Then, here:

1. the attended tier is one source of rows, read in place: with ``TieredCache(..., capacity=N)`` its whole
   preallocated buffers (the rows past the live ones are not valid), else its live rows;
2. the decode-attention op over it (``kvzoo/kernels/decode_attention.py``: reference, SDPA or Triton, as
   ``kvzoo/kernels/dispatch.py`` picks), asking for each row's probability when the policy accumulates
   attention (H2O);
3. or, when the layer has archived rows and a retriever: the op over the tier first for its best score (s*),
   the retriever's scan of its index with the query, the rows it names staged
   (:meth:`~kvzoo.framework.retrieval.Retrieval.fetch_step`: a fixed count, no host synchronisation), and the
   op over them joined to the tier's scores in one softmax (on the kernel path, two parts merged exactly by
   their log-sum-exp);
4. the policy's accumulator (H2O's ``stat:attention``) gets each tier row's probability;
5. accounting: host arithmetic only (the device counts stay on the device until ``stats()``).

The policy's schedule (a per-step "one in, one out", or an event) runs after this, in
:meth:`~kvzoo.framework.runtime.Runtime.after_forward`. Nothing here reads a Python number that changes from
step to step into an op: the ops, shapes and storages of a step repeat between events, which is what a CUDA
graph needs (``tests/test_static_step.py`` records the trace).
"""

from __future__ import annotations

import torch

from kvzoo.framework.layer_state import LayerState
from kvzoo.framework.retrieval import Fetched
from kvzoo.framework.runtime import Runtime
from kvzoo.framework.store import LayerStore
from kvzoo.kernels.decode_attention import Rows, attend


def tier_rows(store: LayerStore) -> Rows:
    """The attended tier as the decode step reads it: in place, valid flags where some row may not be read."""
    keys = store.reading("keys")
    valid = None
    if store.fixed or not store.all_valid:
        valid = store.reading("valid")
        if not store.all_valid:  # a query always reads its own row (a defined output for a padding query)
            valid = valid.clone().scatter_(2, store.tier.last_index(), True)
    if "values" in store.tier:
        return Rows(keys, store.reading("values"), valid=valid)
    return Rows(keys, value_width=store.latent_width, valid=valid)  # MLA: the value is the row's latent part


def fetched_rows(fetched: Fetched, width: int) -> Rows:
    if fetched.values is None:
        return Rows(fetched.keys, value_width=width, valid=fetched.valid, head_valid=fetched.head_valid)
    return Rows(fetched.keys, fetched.values, valid=fetched.valid, head_valid=fetched.head_valid)


def decode_step(rt: Runtime, state: LayerState, query: torch.Tensor, scaling: float) -> torch.Tensor:
    """Attention of one query per sequence ``[B, H, 1, D]`` over the layer's rows: ``[B, H, 1, Dv]``."""
    store = state.store
    q = query[:, :, 0]
    tier = tier_rows(store)
    accumulate = rt.accumulates
    index = state.index if state.index is not None and store.archive.n else None
    if index is None:
        part = attend(q, [tier], scaling, mass=accumulate)
        rt.account_attended(state)
    else:  # the tier's scores first (s*: its best), then the rows the retriever names, in one softmax with them
        part = attend(q, [tier], scaling, best=index.needs_best, defer=True)
        best = part.best[..., None] if part.best is not None else None  # [B, H, 1]
        fetched = rt.retrieval.fetch_step(state, query, best, scaling)
        width = tier.value_width if tier.values is None else tier.values.shape[-1]
        part = attend(q, [fetched_rows(fetched, width)], scaling, prior=part, mass=accumulate)
    if accumulate:  # each tier row's probability in the step, summed over its group's query heads
        stat = store.reading("stat:attention")  # [B, G, n]
        B, G, n = stat.shape
        stat += part.mass[0].view(B, G, -1, n).sum(dim=2)
    return part.out.to(query.dtype)[:, :, None]
