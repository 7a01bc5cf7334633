"""What ``cache.stats()`` reports: a layer's figures (:func:`layer_stats`) from its storage and counters, and a
cache's (:func:`cache_stats`) with the notes the figures alone would not tell. Host numbers only: device counters are
read here, outside the decode step."""

from __future__ import annotations

from typing import Any

import torch

from kvzoo.framework.retrieval import read_figures
from kvzoo.framework.stats import CacheStats, LayerStats


def _number(value: Any) -> float:
    """A counter as a Python number (a device tensor is read here)."""
    if isinstance(value, torch.Tensor):
        value = value.item()
    return int(value) if float(value).is_integer() else float(value)


def layer_stats(layer: Any) -> LayerStats:
    """One tiered layer's figures (``KVLayer.stats()``): rows per sequence and KV group, bytes over the batch."""
    initialized = layer.is_initialized
    store, counts = layer.store, layer.counts
    B, G = store.batch_groups if initialized else (0, 0)
    per_row = store.row_bytes() if initialized else 0
    fetched = _number(counts.fetched_rows)
    index_bytes = counts.index_bytes_scanned + _number(counts.index_bytes_counted)
    info = {k: _number(v) for k, v in counts.policy_info.items()}
    fetched_bytes = fetched * per_row
    attended_bytes = B * G * per_row * counts.tier_rows_read
    if counts.retrieval_steps:  # cumulative reads of the retrieval tier, derived here from the counts
        info.update(retrieval_steps=counts.retrieval_steps, rows_scanned=counts.rows_scanned, rows_fetched=fetched,
                    fetched_bytes=fetched_bytes, attended_bytes_read=attended_bytes,
                    index_bytes_scanned=index_bytes)
    return LayerStats(
        layer=layer.layer_idx,
        seen_rows=counts.seen,
        resident_rows=store.n,
        peak_resident_rows=counts.peak_rows,
        resident_bytes=B * G * store.n * per_row,
        archived_rows=store.archive.positions.n,
        archived_bytes=store.archive.nbytes() if initialized else 0,
        dropped_rows=counts.dropped_rows,
        events=counts.events,
        fetched_rows=fetched,
        kv_bytes_read=attended_bytes + index_bytes + fetched_bytes,
        policy_info=info,
        last_step={k: _number(v) for k, v in read_figures(counts.last_read, B * G, per_row).items()},
    )


def _untiered_stats(layer_idx: int, layer: Any, read: int) -> dict[str, Any]:
    """A layer the policy does not act on: its kind, the rows (a sliding window's) and bytes it holds."""
    tensors = [t for v in vars(layer).values()
               for t in (v.values() if isinstance(v, dict) else v if isinstance(v, (list, tuple)) else [v])
               if isinstance(t, torch.Tensor) and t.dim() > 0]
    window = getattr(layer, "sliding_window", None)
    keys = getattr(layer, "keys", None)
    rows = int(keys.shape[-2]) if window is not None and isinstance(keys, torch.Tensor) and keys.dim() == 4 else -1
    return {"layer": layer_idx, "kind": f"sliding window {window}" if window is not None else type(layer).__name__,
            "resident_rows": rows, "resident_bytes": sum(t.numel() * t.element_size() for t in tensors),
            "kv_bytes_read": read}


def cache_stats(cache: Any) -> CacheStats:
    """A ``TieredCache``'s figures: its tiered layers', the untiered layers' apart, and notes."""
    policy, tiered = cache.policy, cache.tiered_layers
    untiered = [_untiered_stats(i, layer, cache.untiered_read.get(i, 0)) for i, layer in enumerate(cache.layers)
                if layer not in tiered]
    notes = []
    # a block policy whose first block has not closed yet: nothing is compressed, which the figures do not say
    open_rows = [la.counts.since_event for la in tiered if la.counts.events == 0 and la.rank >= policy.dense_layers]
    if policy.schedule == "block" and open_rows and max(open_rows) and not any(la.context_ended for la in tiered):
        notes.append(f"{policy.name}: no block has closed yet ({max(open_rows)} rows wait in an open block of "
                     f"{policy.block_size}): nothing is compressed until a block fills or compress() is called "
                     "(kvzoo.pipeline calls it after the context; model.generate compresses at the prompt's end)")
    if untiered:
        notes.append(f"the figures count the {len(tiered)} layers the policy acts on "
                     f"({[la.layer_idx for la in tiered]}); the {len(untiered)} others keep their own "
                     f"state ({', '.join(sorted({u['kind'] for u in untiered}))}), counted apart as untiered_*")
    return CacheStats(policy=policy.config(), layers=[layer_stats(layer) for layer in tiered], notes=notes,
                      peak_cache_rows=cache.runtime.peak_resident, untiered=untiered)
