"""One decode step of one attention layer, top to bottom.

The layer's ``update`` has written the step's row before the attention runs (an event fired there if the prompt
just ended: ``model.generate``'s first decode step). Then, here:

1. the attended tier is one source of rows, read where the rows lie (``layer.store.source()``: the storage's live
   rows, or the storage at the tier's positions; with ``TieredCache(..., capacity=N)`` whole preallocated buffers
   with the live count on the device);
2. the decode-attention op over it (``kvzoo/kernels/decode_attention/``: its reference, SDPA, native CPU or
   Triton form, as ``kvzoo/kernels/dispatch.py`` picks), asking for each row's probability when the policy
   accumulates attention (H2O);
3. or, when the layer has archived rows and a retriever: the op over the tier first for its best score (s*), the
   retriever's choice among the archived rows (:meth:`~kvzoo.framework.retrieval.Retrieval.fetch_step`: the
   storage at their positions, a fixed count, no host synchronisation), and the op over them joined to the tier's
   part in one softmax (two parts merged exactly by their log-sum-exp);
4. the policy's accumulator (H2O's ``stat:attention``) gets each tier row's probability;
5. accounting: host numbers only (the device count of fetched rows stays on the device until ``stats()``).

The policy's schedule (a per-step "one in, one out", or an event) runs after this, in
:meth:`~kvzoo.framework.runtime.Runtime.after_forward`. Nothing here reads a Python number that changes from
step to step into an op: the ops, shapes and storages of a step repeat between events, which is what a CUDA
graph needs (``tests/test_static_step.py`` records the trace).
"""

from __future__ import annotations

import torch

from kvzoo.framework.layer import KVLayer
from kvzoo.kernels.decode_attention import attend


def decode_step(layer: KVLayer, query: torch.Tensor, scaling: float) -> torch.Tensor:
    """Attention of one query per sequence ``[B, H, 1, D]`` over the layer's rows: ``[B, H, 1, Dv]``."""
    rt = layer.runtime
    q = query[:, :, 0]
    store = layer.store
    tier = store.source()
    accumulate = rt.accumulates
    archive = store.archive
    index = archive.index if archive.index is not None and archive.positions.n else None
    if index is None:
        part = attend(q, [tier], scaling, mass=accumulate)
        rt.account_attended(layer)
    else:  # the tier's scores first (s*: its best), then the rows the retriever names, in one softmax with them
        part = attend(q, [tier], scaling, best=index.needs_best, defer=True, mass=accumulate)
        best = part.best[..., None] if part.best is not None else None  # [B, H, 1]
        fetched = rt.retrieval.fetch_step(layer, query, best, scaling)
        part = attend(q, [fetched], scaling, prior=part, mass=accumulate)
    if accumulate:  # each tier row's probability in the step (the step's first source), over its group's heads
        store.accumulate(part.mass[0])
    return part.out.to(query.dtype)[:, :, None]
