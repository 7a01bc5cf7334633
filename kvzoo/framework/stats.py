"""A layer's running counters (:class:`LayerCounters`, ``KVLayer.counts``) and the figures ``cache.stats()``
reports from them: :class:`LayerStats` per layer and :class:`CacheStats` for a cache.

Rows are counted per sequence and KV group (one token's entry); bytes over the whole batch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(eq=False)
class LayerCounters:
    """One layer's counters (``KVLayer.counts``), rows per sequence and KV group: what the storage appended and let
    go, the events, and what the forwards read. Plain attributes, written in place on the hot path."""

    seen: int = 0  # rows appended: the true sequence length
    seen_dev: torch.Tensor | None = None  # the same on the device, int64 [1]: a decode row's slot
    since_event: int = 0  # rows appended since the last compression event
    new_rows: int = 0  # rows appended by the latest forward (its attention reads which are padding)
    dropped_rows: int = 0
    events: int = 0
    selections: int = 0  # events that ran the selector over the tier (all but a one-in-one-out step)
    peak_rows: int = 0  # most rows the tier held (right after an append)
    # what the forwards read (host numbers, one add each per forward; bytes are derived by stats())
    tier_rows_read: int = 0  # tier rows attended, summed over forwards
    index_bytes_scanned: int = 0  # index bytes scanned, summed over forwards (from each index's scan_cost)
    retrieval_steps: int = 0  # forwards that read the retrieval tier
    rows_scanned: int = 0  # index entries they scanned (over the batch and groups)
    # rows fetched from the archive, on the rows' device
    fetched_rows: torch.Tensor = field(default_factory=lambda: torch.zeros((), dtype=torch.long))
    # index bytes scanned where the choice counted them itself (a pruned scan: data-dependent), on the rows' device
    index_bytes_counted: torch.Tensor = field(default_factory=lambda: torch.zeros((), dtype=torch.long))
    last_read: dict[str, Any] = field(default_factory=dict)  # the latest forward's reads (stats derives its bytes)
    policy_info: dict[str, Any] = field(default_factory=dict)  # the policy's and the retriever's counters

    def attended(self, rows: int) -> None:
        """A forward read ``rows`` tier rows and no archived row (host numbers; ``stats()`` derives the bytes)."""
        self.tier_rows_read += rows
        self.last_read = {"tier_rows": rows}


@dataclass
class LayerStats:
    """Rows are counted per sequence and KV group (one token's entry); bytes over the whole batch."""

    layer: int
    seen_rows: int
    resident_rows: int
    peak_resident_rows: int
    resident_bytes: int
    archived_rows: int
    archived_bytes: int
    dropped_rows: int
    events: int
    fetched_rows: int
    # KV-path bytes this layer's attention has read, every forward counted (prefill, question, answer,
    # decode): attended rows + index entries scanned + rows fetched
    kv_bytes_read: int = 0
    policy_info: dict[str, float] = field(default_factory=dict)  # the policy's and retriever's counters
    last_step: dict[str, float] = field(default_factory=dict)  # the latest forward's KV-path figures

    @classmethod
    def counters(cls) -> tuple[str, ...]:
        """The cache's own counters: every field but the layer index and the two dicts of figures."""
        return tuple(f.name for f in dataclasses.fields(cls) if f.name not in ("layer", "policy_info", "last_step"))

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class CacheStats:
    policy: dict[str, Any]
    layers: list[LayerStats] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what the figures alone would not tell (nothing compressed yet)
    # the most rows every layer held at once (summed over layers, per sequence and KV group): what a prefill's peak
    # memory follows (one layer at a time holds its whole prompt when the context ends inside the forward)
    peak_cache_rows: int = 0
    # the layers the policy does not act on (a hybrid model's sliding-window layers, Kimi Linear's linear-attention
    # layers), counted apart so that no figure is stated over the tiered layers alone: one dict per layer with its
    # ``layer``, ``kind``, ``resident_rows`` (-1: a fixed-size state, not rows), ``resident_bytes`` and
    # ``kv_bytes_read`` (what the forwards' attention read from it, where the cache sees it)
    untiered: list[dict[str, Any]] = field(default_factory=list)

    @property
    def totals(self) -> dict[str, float]:
        """Sums over layers of every counter, the policy's own counters included."""
        out: dict[str, float] = {k: sum(getattr(s, k) for s in self.layers) for k in LayerStats.counters()}
        out["peak_resident_rows"] = max((s.peak_resident_rows for s in self.layers), default=0)  # per layer, max
        for k, v in self.policy_totals.items():
            out[k] = out.get(k, 0) + v
        if self.untiered:  # beside the tiered figures, never inside them
            out["untiered_resident_bytes"] = sum(u["resident_bytes"] for u in self.untiered)
            out["untiered_kv_bytes_read"] = sum(u["kv_bytes_read"] for u in self.untiered)
        return out

    @property
    def policy_totals(self) -> dict[str, float]:
        """The policy's and the retriever's own counters (``LayerStats.policy_info``), summed over layers."""
        out: dict[str, float] = {}
        for s in self.layers:
            for k, v in s.policy_info.items():
                out[k] = out.get(k, 0) + v
        return out

    def as_dict(self) -> dict[str, Any]:
        return {"policy": self.policy, "totals": self.totals, "layers": [s.as_dict() for s in self.layers],
                "notes": list(self.notes), "peak_cache_rows": self.peak_cache_rows,
                "untiered": [dict(u) for u in self.untiered]}

    def __str__(self) -> str:
        t = self.totals
        n = max(1, len(self.layers))
        head = (
            f"policy {self.policy.get('name')}: {len(self.layers)} layers, "
            f"resident {t['resident_rows'] / n:.0f} rows/layer ({t['resident_bytes'] / 2**20:.2f} MiB), "
            f"archived {t['archived_rows'] / n:.0f} rows/layer ({t['archived_bytes'] / 2**20:.2f} MiB), "
            f"dropped {t['dropped_rows'] / n:.0f} rows/layer, seen {t['seen_rows'] / n:.0f} rows/layer, "
            f"events {t['events']}, fetched {t['fetched_rows']}"
        )
        extra = {k: v for k, v in t.items() if k not in LayerStats.__dataclass_fields__}
        if extra:
            head += ", " + ", ".join(f"{k} {v:g}" for k, v in extra.items())
        rows = ["layer  seen  resident  archived  dropped  events  resident_KiB"]
        for s in self.layers:
            rows.append(
                f"{s.layer:5d} {s.seen_rows:5d} {s.resident_rows:9d} {s.archived_rows:9d} {s.dropped_rows:8d} "
                f"{s.events:7d} {s.resident_bytes / 1024:13.1f}"
            )
        if self.untiered:
            kinds = sorted({u["kind"] for u in self.untiered})
            head += (f"\n{len(self.untiered)} layers the policy does not act on ({', '.join(kinds)}; layers "
                     f"{[u['layer'] for u in self.untiered]}): resident "
                     f"{sum(u['resident_bytes'] for u in self.untiered) / 2**20:.2f} MiB beside the figures above")
        notes = [f"note: {note}" for note in self.notes]
        return "\n".join([head, *notes, *rows])
