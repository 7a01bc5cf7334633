"""One layer's state beside its rows (:class:`LayerState`): the budget, the retriever's index, the accounting.

Below both the runtime (which decides a row's fate) and the retrieval tier (which indexes and fetches archived
rows): each reads and writes a layer's state, neither imports the other for it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from kvzoo.framework.retriever import RetrievalState
from kvzoo.framework.store import LayerStore

__all__ = ["LayerState"]


@dataclass
class LayerState:
    """What the runtime keeps for one layer beside its rows: the budget, the index, the accounting."""

    layer_idx: int
    layer_rank: int  # index among the layers kvzoo compresses (Kimi Linear: MLA layers only)
    store: LayerStore = field(default_factory=LayerStore)
    index: RetrievalState | None = None  # the retriever's state over this layer's archive
    budget: int | None = None  # fixed at the first event
    scaling: float | None = None  # the attention's softmax scale (for the observation window)
    window_queries: torch.Tensor | None = None  # [B, H, w, D], the latest queries
    fetched_rows: torch.Tensor = field(default_factory=lambda: torch.zeros((), dtype=torch.long))  # on device
    attended_bytes_read: int = 0  # every forward: bytes of the tier it attended (host arithmetic)
    index_bytes_scanned: int = 0  # every forward: bytes of index entries it scanned
    policy_info: dict[str, Any] = field(default_factory=dict)  # the policy's and retriever's counters
    last_step: dict[str, Any] = field(default_factory=dict)  # the latest forward's KV-path accounting
    context_ended: bool = False  # the context_end event fired (compress(), or the prompt's end in generate)
    # the "inputs" observation since the layer's last event: the attention module (a weak reference: the cache never
    # keeps the model alive, and fork() never copies it) and its input hidden states / RoPE (cos, sin) per forward
    inputs: dict[str, Any] = field(default_factory=dict)
