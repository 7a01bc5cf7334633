"""One layer's rows: the attended tier, the archive, per-row statistics, and what they count.

Per layer and sequence, every row ever appended is in exactly one place (docs/architecture.md): the
**attended tier** (what every step attends to) or the **archive** (evicted rows, bit-exact, with
their slots); with eviction to nowhere (``archive=False``) a row is dropped and counted. The store
appends rows, keeps the rows it is told to keep, hands back the others, and reports; which rows
stay is decided elsewhere (``framework/runtime.py``). It knows no policy, holds no reference to a
cache, and imports torch and the row buffers alone.

Also here: :class:`LayerStats` and :class:`CacheStats`, the figures ``cache.stats()`` reports.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from kvzoo.framework.buffers import RowStore, gather_rows

ARCHIVED = ("keys", "values", "slots", "valid")  # the buffers a row keeps in the archive (no statistics)
EMPTY = {"valid": False, "slots": -1}  # what a row past the live ones holds: never readable, no slot


class LayerStore:
    """The attended tier and the archive of one layer, ``[B, G, rows, ...]`` each, and its counters.

    ``tier`` (:class:`~kvzoo.framework.buffers.RowStore`): ``keys``, ``values`` (GQA; MLA latent
    rows are keys and values at once), ``slots`` (a row's index in the sequence, padding counted),
    ``valid`` (False for padding) and ``stat:<name>`` per-row statistics. ``archive``: the same
    without statistics. Rows are counted per (batch, group); bytes over the whole batch.
    """

    def __init__(self) -> None:
        self.tier = RowStore()
        self.archive = RowStore()
        self.seen = 0  # rows appended per (batch, group): the true sequence length
        self.since_event = 0  # rows appended since the last compression event
        self.new_rows = 0  # rows appended by the forward in flight
        self.dropped_rows = 0
        self.events = 0
        self.selections = 0  # events that ran the selector over the tier (every event but a one-in-one-out step)
        self.peak_rows = 0  # most rows the tier held (right after an append)
        # every row appended so far is known to be valid (no padding); a single-token forward that
        # carries a mask cannot be checked without a host sync, so it clears this
        self.all_valid = True
        self.latent_width: int | None = None  # MLA: the latent c's width (values are keys[..., :width])
        # TieredCache(..., capacity=N): the most rows this layer will see; the buffers are preallocated and fixed
        # (a decode step reads them whole), None: they grow as rows arrive
        self.capacity: int | None = None
        self.seen_dev: torch.Tensor | None = None  # ``seen`` on the rows' device, int64 [1]: a decode row's slot

    @property
    def initialized(self) -> bool:
        return bool(self.tier.buffers)

    def define(
        self, keys: torch.Tensor, values: torch.Tensor | None, stats: tuple[str, ...], reserve: int = 0,
        latent_width: int | None = None, capacity: int | None = None,
    ) -> None:
        """Create the buffers from the first rows' shapes and dtypes (``[B, G, q, ...]``).

        ``capacity`` (the most rows the layer will see): the tier is preallocated for it and fixed; the archive
        is allocated for it when the first row leaves the tier.
        """
        B, G = keys.shape[:2]
        fields: dict[str, tuple[tuple[int, ...], torch.dtype]] = {"keys": ((keys.shape[-1],), keys.dtype)}
        if values is not None:
            fields["values"] = ((values.shape[-1],), values.dtype)
        fields.update(slots=((), torch.long), valid=((), torch.bool))
        fixed = capacity is not None
        self.archive.define(B, G, fields, keys.device, fixed=fixed, empty=EMPTY)
        for name in stats:
            fields[f"stat:{name}"] = ((), torch.float32)
        self.tier.define(B, G, fields, keys.device, capacity=capacity or reserve, fixed=fixed, empty=EMPTY)
        self.latent_width = latent_width
        self.capacity = capacity
        self.seen_dev = torch.zeros(1, dtype=torch.long, device=keys.device)

    # --- the live rows ---------------------------------------------------------------------------
    @property
    def n(self) -> int:
        return self.tier.n

    def get(self, name: str) -> torch.Tensor:
        """The tier's live rows of buffer ``name`` (a view; rows may be out of slot order)."""
        return self.tier.get(name)

    def values(self) -> torch.Tensor:
        """What attention reads as values: ``values`` (GQA) or the latent part ``c`` of MLA rows (a view)."""
        if "values" in self.tier:
            return self.tier.get("values")
        return self.tier.get("keys")[..., : self.latent_width]

    @property
    def fixed(self) -> bool:
        """The buffers are preallocated for ``capacity`` rows: a decode step reads them whole."""
        return self.capacity is not None

    def reading(self, name: str) -> torch.Tensor:
        """What a decode step reads of the tier's ``name``: the whole buffer when the capacity is fixed (rows past
        the live ones are not valid), else the live rows (:meth:`RowStore.reading`)."""
        if name == "values" and "values" not in self.tier:  # MLA: the latent part of the rows
            return self.tier.reading("keys")[..., : self.latent_width]
        return self.tier.reading(name)

    def stats(self) -> dict[str, torch.Tensor]:
        """The per-row statistics ``name -> [B, G, n]`` (views)."""
        return {name[5:]: self.tier.get(name) for name in self.tier.buffers if name.startswith("stat:")}

    def row_bytes(self) -> int:
        """Bytes of one row of one (batch, group): its key (latent row on MLA) and its value (GQA)."""
        per = 0
        for name in ("keys", "values"):
            if name in self.tier:
                buf = self.tier.buffers[name]
                per += buf.shape[-1] * buf.element_size()
        return per

    # --- appending ---------------------------------------------------------------------------------
    def append(self, keys: torch.Tensor, values: torch.Tensor | None) -> None:
        """Append one forward's rows ``[B, G, q, D]`` after the tier's rows (valid until marked padding).

        A decode step's row takes its slot from ``seen_dev`` (a device tensor): no Python number that changes
        from step to step reaches an op.
        """
        B, G, q = keys.shape[:3]
        rows: dict[str, Any] = {"keys": keys, "valid": True}
        if values is not None:
            rows["values"] = values
        if q == 1:
            rows["slots"] = self.seen_dev.view(1, 1, 1).expand(B, G, 1)
        else:
            rows["slots"] = torch.arange(self.seen, self.seen + q, device=keys.device)
        for name in self.tier.buffers:
            if name.startswith("stat:"):
                rows[name] = 0.0
        self.tier.append(rows, count=q)
        self.seen += q
        if q == 1:
            self.seen_dev.add_(1)
        else:
            self.seen_dev.fill_(self.seen)
        self.since_event += q
        self.new_rows = q
        self.peak_rows = max(self.peak_rows, self.tier.n)

    def mark_padding(self, padding_mask: torch.Tensor | None) -> None:
        """Set the validity of the rows the forward in flight appended, from the 2-D padding mask.

        ``padding_mask`` is ``[B, seen]`` bool over slots (True = real token), or None (no padding).
        A multi-token forward checks the new rows on the host (prefill may synchronise); a decode
        step only writes the flags, and its attention then honours them (no host sync per step).
        """
        q = self.new_rows
        if padding_mask is None or q == 0:
            return
        n = self.tier.n
        if q == 1:  # written where the row went (the device's length - 1): no host number, no host check
            new = padding_mask[:, -1:].to(torch.bool)  # [B, 1], the new token's flag
            B, G = self.tier.buffers["valid"].shape[:2]
            self.tier.buffers["valid"].scatter_(2, self.tier.last_index(), new[:, None, :].expand(B, G, 1))
            self.all_valid = False
            return
        new = padding_mask[:, self.seen - q : self.seen].to(torch.bool)  # [B, q]
        self.tier.get("valid")[:, :, n - q : n] = new[:, None, :]
        if not bool(new.all()):
            self.all_valid = False

    # --- moving rows out -------------------------------------------------------------------------
    def not_kept(self, keep: torch.Tensor) -> dict[str, torch.Tensor]:
        """The tier's rows that ``keep [B, G, k]`` (sorted indices) does not name, in order (archive buffers)."""
        return self.tier.gather(self.tier.complement(keep), ARCHIVED)

    def keep(self, keep: torch.Tensor) -> None:
        """Keep rows ``keep [B, G, k]`` (sorted) as the tier; the others must have been taken first."""
        self.tier.keep(keep)
        self.selections += 1

    def row(self, victim: torch.Tensor) -> dict[str, torch.Tensor]:
        """Row ``victim[b, g]`` of every (batch, group), ``[B, G, 1, ...]`` (archive buffers): one gather each."""
        idx = victim[..., None]
        return {name: gather_rows(self.tier.buffers[name], idx) for name in ARCHIVED if name in self.tier}

    def remove_one(self, victim: torch.Tensor) -> None:
        """Take row ``victim[b, g]`` out of the tier without moving a row: the next appended row takes its place
        (:meth:`RowStore.vacate`, ``O(1)``)."""
        self.tier.vacate(victim)

    def add_to_archive(self, rows: dict[str, torch.Tensor]) -> None:
        if self.capacity is not None and self.archive.capacity == 0:  # the first eviction: room for every row
            self.archive.resize(self.capacity)
        self.archive.append({name: rows[name] for name in self.archive.buffers})

    def fit_tier(self, rows: int) -> None:
        """Fixed capacity, after an event: hold the tier at ``rows`` rows of storage (the most it can reach
        before the next event), so that a decode step reads no more than it may need."""
        if self.capacity is not None:
            self.tier.resize(max(rows, self.tier.n))

    def drop(self, count: int) -> None:
        """Count ``count`` rows per (batch, group) evicted to nowhere (``archive=False``)."""
        self.dropped_rows += count

    def ensure_order(self) -> None:
        """Sort the tier back into slot order (after ``remove_one``); a no-op when it is in order."""
        self.tier.ensure_order()

    # --- batch ---------------------------------------------------------------------------------
    def select_batch(self, index: torch.Tensor) -> None:
        self.tier.select_batch(index)
        self.archive.select_batch(index)

    def repeat_batch(self, repeats: int) -> None:
        self.tier.repeat_batch(repeats)
        self.archive.repeat_batch(repeats)


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

    @property
    def totals(self) -> dict[str, float]:
        """Sums over layers of every counter, the policy's own counters included."""
        out: dict[str, float] = {k: sum(getattr(s, k) for s in self.layers) for k in LayerStats.counters()}
        out["peak_resident_rows"] = max((s.peak_resident_rows for s in self.layers), default=0)  # per layer, max
        for k, v in self.policy_totals.items():
            out[k] = out.get(k, 0) + v
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
                "notes": list(self.notes)}

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
        notes = [f"note: {note}" for note in self.notes]
        return "\n".join([head, *notes, *rows])
