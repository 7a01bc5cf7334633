"""One layer's storage (:class:`LayerStorage`, ``KVLayer.store``): its rows, the two views over them -- the attended
tier and the archive (:class:`LayerArchive`: the archived rows' positions and the retriever's index over them) --,
and the operations that write, move and read them.

A row is written once and never moves. With an archive the storage keeps every row in arrival order (a row's
position is its slot); after the first eviction the tier is a list of positions, and the archive the positions
evicted, in eviction order (the order of the index entries). Without one the storage holds the tier alone: an event
keeps the selected rows at the front, and a "one in, one out" step leaves a hole the next row fills
(docs/row-life.md). The runtime decides which rows go where; the storage reaches it only through
:class:`StorageHost` and names no concrete policy.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from kvzoo.framework.buffers import RowStore, complement, gather_rows
from kvzoo.framework.plugins import PluginError, plugin_label
from kvzoo.framework.retriever import ArchiveView
from kvzoo.framework.stats import LayerCounters
from kvzoo.kernels.attention import received_attention
from kvzoo.kernels.decode_attention import Rows

EMPTY = {"valid": False, "slots": -1}  # what a storage row past the live ones holds: never readable, no slot
NO_ROW = {"pos": -1}  # a position list's spare entries: no row (the decode op never reads a position < 0)
ARCHIVED_FIELDS = ("keys", "values", "slots", "valid")  # what an archived row keeps (its statistics stop counting)


def row_fields(key_states: torch.Tensor, value_states: torch.Tensor | None,
               accumulates: bool) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """A storage row's fields (name -> per-row shape, dtype) for rows like ``key_states`` and ``value_states`` (GQA;
    None on MLA), with H2O's accumulator (zero for a new row) when the policy ``accumulates``."""
    fields: dict[str, tuple[tuple[int, ...], torch.dtype]] = {"keys": ((key_states.shape[-1],), key_states.dtype)}
    if value_states is not None:
        fields["values"] = ((value_states.shape[-1],), value_states.dtype)
    fields.update(slots=((), torch.long), valid=((), torch.bool))
    if accumulates:
        fields["stat:attention"] = ((), torch.float32)
    return fields


def check_indices(policy: Any, method: str, chosen: Any, shape: tuple[int, ...], device: torch.device, end: int = 0,
                  tier: int = 0) -> None:
    """Refuse (naming ``policy``, a Policy) what its ``method()`` returned unless it is int64 tier indices of ``shape``
    on ``device``; a selection (``end``) must also be sorted, unrepeated and below ``end``, a victim (``tier``) one of
    the ``tier`` rows (both checked on the device: no host synchronisation)."""
    if not isinstance(chosen, torch.Tensor) or chosen.shape != shape or chosen.dtype != torch.long \
            or chosen.device != device:
        got = (f"{chosen.dtype} {tuple(chosen.shape)} on device {chosen.device}" if isinstance(chosen, torch.Tensor)
               else type(chosen).__name__ if chosen is not None else "None")
        raise PluginError(f"{plugin_label(policy, 'policy')}: {method}() must return int64 indices of shape {shape} on "
                          f"device {device} (the rows'), got {got}")
    if end and shape[-1]:
        ok = (chosen.min() >= 0) & (chosen.max() < end) & (chosen.diff(dim=-1) > 0).all()
        torch._assert_async(ok, f"{plugin_label(policy, 'policy')}: select() returned indices that are out of range "
                                f"(valid: 0 to {end - 1}), unsorted or repeated")
    if tier:
        torch._assert_async(((chosen >= 0) & (chosen < tier)).all(),
                            f"{plugin_label(policy, 'policy')}: step_victim() returned a row outside the tier of {tier} "
                            f"rows (valid: 0 to {tier - 1}, per sequence and KV group)")


class StorageHost(Protocol):
    """What a layer's storage asks of the cache runtime (``kvzoo.framework.runtime.Runtime``): the policy and
    geometry it reads, the cache-wide resident count, and two calls: the rows it holds changed, a new index."""

    policy: Any
    geometry: Any
    resident: int
    peak_resident: int

    @property
    def accumulates(self) -> bool: ...

    def held(self, change: int) -> None: ...

    def new_index(self) -> Any: ...


class LayerStorage:
    """One layer's rows, the attended tier and the archive over them (module docstring), and the counters it keeps."""

    def __init__(self, runtime: StorageHost, counts: LayerCounters) -> None:
        self.runtime = runtime
        self.counts = counts
        self.retains = bool(runtime.policy.archive)  # evicted rows stay in the storage (the archive)
        self.rows = RowStore()  # the storage: "keys", "values" (GQA), "slots", "valid", "stat:<name>"
        self.tier = RowStore()  # with an archive, after the first eviction: "pos", the tier's positions in rows
        self.gathered = False  # the tier is the position list (else the storage's live rows)
        # the archived rows' positions and their index (told when some row may be padding: no reference back here,
        # so the storage and its archive are freed when their last reference goes, not by the garbage collector)
        self.archive = LayerArchive(runtime, counts, self.rows, padded=False)
        self.budget: int | None = None  # the tier's rows, fixed at the first event
        self.all_valid = True  # no row appended is padding (a forward with a padding mask clears it: no host sync)
        self.device: torch.device | None = None

    def define(self, key_states: torch.Tensor, value_states: torch.Tensor | None, reserve_rows: int | None) -> None:
        """Lay out the buffers for rows like ``key_states`` (``[B, G, q, D]``) and ``value_states`` (GQA)."""
        B, G = key_states.shape[:2]
        fields = row_fields(key_states, value_states, self.runtime.accumulates)
        capacity, fixed = self.capacity, self.capacity is not None
        device = key_states.device
        self.rows.define(B, G, fields, device, capacity=capacity or reserve_rows or 0, fixed=fixed, empty=EMPTY)
        if self.retains:
            self.define_lists(B, G, device, fixed)
        counts = self.counts
        counts.seen_dev = torch.zeros(1, dtype=torch.long, device=device)
        counts.fetched_rows = counts.fetched_rows.to(device)
        counts.index_bytes_counted = counts.index_bytes_counted.to(device)
        self.device = device

    def define_lists(self, B: int, G: int, device: torch.device, fixed: bool, *, refix: bool = False) -> None:
        """Lay out the tier's and the archive's position lists; ``refix``: fix those laid out already."""
        for view in (self.tier, self.archive.positions):
            if not view.buffers:
                view.define(B, G, {"pos": ((), torch.long)}, device, fixed=fixed, empty=NO_ROW)
            elif refix:
                view.fix(view.capacity, NO_ROW)

    @property
    def capacity(self) -> int | None:
        """``TieredCache(..., capacity=N)``: storage preallocated for N rows, read whole by a decode step."""
        return self.runtime.geometry.capacity

    @property
    def latent_width(self) -> int | None:
        """MLA: the latent c's width (a row's value is its first ``latent_width`` dims); GQA: None."""
        geometry = self.runtime.geometry
        return geometry.content_dim if geometry.layout == "mla" else None

    @property
    def n(self) -> int:
        """Rows in the attended tier, per (batch, group)."""
        return self.tier.n if self.gathered else self.rows.n

    def row_bytes(self) -> int:
        """Bytes of one row of one (batch, group): its key (the latent row on MLA) and its value (GQA)."""
        return sum(buf.shape[-1] * buf.element_size() for name, buf in self.rows.buffers.items()
                   if name in ("keys", "values"))

    @property
    def batch_groups(self) -> tuple[int, int]:
        return tuple(self.rows.buffers["keys"].shape[:2])  # type: ignore[return-value]

    def outgrows(self, tier_rows: int, appended: int, archived: int) -> bool:
        """Whether the storage must grow for a tier of ``tier_rows`` rows, ``appended`` more rows, ``archived`` more."""
        if tier_rows > (self.tier if self.gathered else self.rows).capacity:
            return True
        archive = self.archive.positions  # with an archive the storage keeps every row
        return self.retains and (self.rows.n + appended > self.rows.capacity
                                 or archived > 0 and archive.n + archived > archive.capacity)

    def brought_bytes(self) -> int:
        """Bytes of the rows the layer's latest forward appended (0 before its first rows)."""
        if not self.rows.buffers:
            return 0
        batch, groups = self.batch_groups
        return self.counts.new_rows * self.row_bytes() * batch * groups

    def fit(self, rows: int) -> None:
        """A fixed capacity's tier storage sized to ``rows`` (with an archive: the tier's position list, once there is one)."""
        if self.retains and not self.gathered:
            return
        storage = self.tier if self.gathered else self.rows
        storage.resize(max(rows, storage.n))

    # --- appending -----------------------------------------------------------------------------------
    def append(self, keys: torch.Tensor, values: torch.Tensor | None) -> None:
        """Write one forward's rows ``[B, G, q, D]`` where they land, valid until marked padding. A decode step's row
        takes its slot from ``counts.seen_dev``: no Python number that changes from step to step reaches an op."""
        B, G, q = keys.shape[:3]
        counts = self.counts
        rows: dict[str, Any] = {"keys": keys, "valid": True}
        if values is not None:
            rows["values"] = values
        if q == 1:
            slots = counts.seen_dev.view(1, 1, 1).expand(B, G, 1)
        else:
            slots = torch.arange(counts.seen, counts.seen + q, device=keys.device).expand(B, G, q)
        rows["slots"] = slots
        for name in self.rows.buffers:
            if name.startswith("stat:"):
                rows[name] = 0.0
        self.rows.append(rows, count=q)
        if self.gathered:  # with an archive a row's position is its slot
            self.tier.append({"pos": slots}, count=q)
        counts.seen += q
        if q == 1:
            counts.seen_dev.add_(1)
        else:
            counts.seen_dev.fill_(counts.seen)
        counts.since_event += q
        counts.new_rows = q
        counts.peak_rows = max(counts.peak_rows, self.tier.n if self.gathered else self.rows.n)
        runtime = self.runtime  # Runtime.held(q), in place: a decode step appends per layer
        runtime.resident += q
        if runtime.resident > runtime.peak_resident:
            runtime.peak_resident = runtime.resident

    def mark_padding(self, padding_mask: torch.Tensor) -> None:
        """The validity of the forward's new rows from the padding mask ``[B, seen]`` (a decode step: no host sync)."""
        q = self.counts.new_rows
        if q == 0:
            return
        valid = self.rows.buffers["valid"]
        if q == 1:  # written where the row went (found on the device)
            B, G = valid.shape[:2]
            new = padding_mask[:, -1:].to(torch.bool)  # [B, 1]
            valid.scatter_(2, self.rows.last_index(), new[:, None, :].expand(B, G, 1))
            self.mark_padded()
            return
        n, seen = self.rows.n, self.counts.seen
        new = padding_mask[:, seen - q : seen].to(torch.bool)  # [B, q]
        self.rows.get("valid")[:, :, n - q : n] = new[:, None, :]
        if not bool(new.all()):
            self.mark_padded()

    def mark_padded(self) -> None:
        """Some row appended may be padding: the attention masks it and the archive's scans read the rows' flags."""
        self.all_valid = False
        self.archive.padded = True

    # --- the attended tier -----------------------------------------------------------------------------
    def get(self, name: str) -> torch.Tensor:
        """The tier's rows of ``name`` ``[B, G, n, ...]`` in tier order (a view, or a gathered tier's copy); MLA's
        ``"values"`` are the rows' latent part."""
        if name == "values" and "values" not in self.rows.buffers:
            return self.get("keys")[..., : self.latent_width]
        if not self.gathered:
            return self.rows.get(name)
        return gather_rows(self.rows.buffers[name], self.tier.get("pos"))

    def row_statistics(self) -> dict[str, torch.Tensor]:
        """The per-row statistics ``name -> [B, G, n]`` of the tier rows, in tier order."""
        stats = {}
        for name in self.rows.buffers:  # a loop, not a comprehension: a policy's victim reads this per step
            if name.startswith("stat:"):
                stats[name[5:]] = self.get(name)
        return stats

    def ensure_order(self) -> None:
        """Put the tier back in slot order (a one-in-one-out step leaves it out of order); a no-op when it is."""
        if self.gathered:
            self.tier.ensure_order("pos")  # positions are slots
        else:
            self.rows.ensure_order("slots")

    def source(self) -> Rows:
        """The tier as one source of the decode op, read in place: the storage's live rows (with a fixed capacity,
        whole buffers and the live count on the device), or the storage at the tier's positions."""
        rows = self.rows
        keys = rows.reading("keys")
        values = rows.reading("values") if "values" in rows.buffers else None
        width = None if values is not None else self.latent_width
        valid = None
        if not self.all_valid:  # padding: a query always reads its own row (a defined output for a padding query)
            valid = rows.buffers["valid"].clone().scatter_(2, rows.last_index(), True)
            if not rows.fixed and not self.gathered:
                valid = valid[:, :, : rows.n]
        B = keys.shape[0]
        if not self.gathered:
            length = rows.length.expand(B) if rows.fixed else None
            return Rows(keys, values, value_width=width, valid=valid, length=length)
        positions = self.tier.reading("pos")
        length = self.tier.length.expand(B) if self.tier.fixed else None
        return Rows(rows.buffers["keys"], rows.buffers.get("values"), value_width=width, indices=positions,
                    length=length, pool_valid=valid)

    def accumulate(self, mass: torch.Tensor, *, step: bool = True) -> None:
        """Add each tier row's attention ``mass [B, H, N]``, summed over its group's heads, to its ``stat:attention``:
        a decode step's over the positions :meth:`source` read (spare ones, -1, carry none), else in tier order."""
        stat = self.rows.buffers["stat:attention"]
        per_group = received_attention(mass, stat.shape[1])  # [B, G, N]
        if self.gathered:
            positions = self.tier.reading("pos") if step else self.tier.get("pos")
            stat.scatter_add_(2, positions.clamp(min=0), per_group)
        else:
            stat[:, :, : per_group.shape[-1]] += per_group

    # --- eviction -------------------------------------------------------------------------------------
    def evict(self, policy: Any, *, victim: torch.Tensor | None = None, keep: torch.Tensor | None = None,
              target: int = 0, end: int = 0, tier: int = 0) -> int:
        """Policy ``policy``'s rows leave the tier (to the archive, indexed first, or dropped), once checked: one
        ``victim [B, G]`` (``step_victim()``'s, checked to lie in the first ``tier`` rows when ``tier``; the next row
        appended takes its place), or all but the ``target`` rows ``keep`` (``select()``'s) of the first ``end``
        (every later row stays). Returns the bytes given back."""
        keys = self.rows.buffers["keys"]
        B, G = keys.shape[:2]
        if victim is not None:
            check_indices(policy, "step_victim", victim, (B, G), keys.device, tier=tier)
            self.runtime.resident -= 1  # Runtime.held(-1): one row less can raise no peak
            self.counts.events += 1
            if not self.retains:
                self.rows.vacate(victim)
                self.counts.dropped_rows += 1
                return 0  # nothing given back: the next row appended fills the hole
            if not self.gathered:
                self._gather_tier()
            # an index out of range fails here
            self.archive.add(self.tier.buffers["pos"].gather(2, victim[..., None]), self.tier_view, self.budget)
            self.tier.vacate(victim)
            return 0
        check_indices(policy, "select", keep, (B, G, target), keys.device, end)
        n = self.n
        if end < n:
            keep = torch.cat([keep, torch.arange(end, n, device=keep.device).expand(B, G, n - end)], dim=2)
        k = keep.shape[2]
        self.runtime.held(k - n)
        if not self.retains:
            self.rows.keep(keep)
            self.counts.dropped_rows += n - k
        else:
            if not self.gathered:
                self._gather_tier()
            leaving = self.tier.gather(complement(keep, n), ("pos",))["pos"]  # [B, G, n - k], in tier order
            self.archive.add(leaving, self.tier_view, self.budget)
            self.tier.keep(keep)
        self.counts.selections += 1
        self.counts.events += 1
        return 0 if self.retains else (n - k) * self.row_bytes() * B * G

    def _gather_tier(self) -> None:
        """The first eviction of a layer with an archive: the tier becomes the list of its positions (all so far)."""
        B, G = self.batch_groups
        n = self.rows.n
        if self.tier.fixed:
            self.tier.resize(self.capacity or n)
        self.tier.append({"pos": torch.arange(n, device=self.device).expand(B, G, n)}, count=n)
        self.gathered = True

    def select_batch(self, idx: torch.Tensor) -> None:
        """Keep batch elements ``idx`` (beam reordering): rows, views and the index move together."""
        for store in (self.rows, self.tier):
            if store.buffers:
                store.select_batch(idx)
        self.archive.select_batch(idx)

    def repeat_batch(self, repeats: int) -> None:
        for store in (self.rows, self.tier):
            if store.buffers:
                store.repeat_batch(repeats)
        self.archive.repeat_batch(repeats)

    def tier_view(self) -> ArchiveView:
        """The tier's rows as an :class:`ArchiveView` (read when asked: a retriever fitting its basis reads them)."""
        return ArchiveView(read=self.get, rows=self.n, groups=self.batch_groups[1])


class LayerArchive:
    """A layer's archive (``store.archive``): the positions in the storage of the rows evicted to it (``positions``,
    ``"pos"``, in eviction order -- the order of the retriever's index entries), the retriever's index over them
    (``index``, None without a retriever), and their reads (gathered from the storage's ``rows``)."""

    def __init__(self, runtime: StorageHost, counts: LayerCounters, rows: RowStore,
                 padded: bool = True) -> None:
        self.runtime = runtime
        self.padded = padded  # whether some stored row may be padding (host state, kept by the storage: no sync)
        self.counts = counts  # the layer's counters: a decode step's view carries its fetched-rows counter
        self.rows = rows  # the storage the positions point into
        self.positions = RowStore()  # with an archive: "pos", the archived rows' positions, in eviction order
        self.index = runtime.new_index()  # the retriever's state over the archive (None without a retriever)

    @property
    def n(self) -> int:
        return self.positions.n

    def select_batch(self, idx: torch.Tensor) -> None:
        if self.positions.buffers:
            self.positions.select_batch(idx)
        if self.index is not None:
            self.index.select_batch(idx)

    def repeat_batch(self, repeats: int) -> None:
        if self.positions.buffers:
            self.positions.repeat_batch(repeats)
        if self.index is not None:
            self.index.repeat_batch(repeats)

    def add(self, positions: torch.Tensor, tier_view: Callable[[], ArchiveView], budget: int | None) -> None:
        """Rows at ``positions [B, G, k]`` leave the tier for the archive: indexed (the tier still holds them; a
        retriever that gathers them reads ``tier_view()``), then listed."""
        archived = self.positions
        if archived.fixed and archived.capacity == 0:  # the first eviction: room for every row
            archived.resize(self.runtime.geometry.capacity)
        storage = self.rows.buffers
        if self.index is not None and not self.index.index_in_place(storage, positions):  # else: gathered
            leaving = {name: gather_rows(storage[name], positions) for name in ("keys", "valid")}
            self.index.index(leaving, tier_view(), self.view(budget))
        archived.append({"pos": positions})

    def view(self, budget: int | None, *, whole: bool = False, step: bool = False) -> ArchiveView:
        """The archived rows, in archive order, as an :class:`ArchiveView` (gathered when read), for a tier of
        ``budget`` rows. ``whole``: a fixed-capacity archive's whole list (spare positions read as padding).
        ``step``: a decode step's view, with the position list, the fetched-rows counter and, where the policy
        archives the step's own row next, that row where it lies (``own_row``)."""
        archived = self.positions
        rows = archived.capacity if (whole and archived.fixed) else archived.n
        extra = {}
        if step:
            extra = {"positions": archived.reading("pos") if whole else archived.get("pos"),
                     "fetched": self.counts.fetched_rows}
            if self.runtime.policy.own_row_archived_next:
                storage = self.rows
                extra["own_row"] = lambda: (storage.buffers["keys"], storage.buffers["valid"],
                                            storage.last_index()[..., 0])

        def read(name: str) -> torch.Tensor:
            positions = archived.reading("pos") if whole else archived.get("pos")
            picked = gather_rows(self.rows.buffers[name], positions.clamp(min=0))
            if name == "valid":
                picked = picked & (positions >= 0)
            return picked

        return ArchiveView(read=read, budget=budget, rows=rows, groups=self.rows.buffers["keys"].shape[1],
                           padded=self.padded, **extra)

    def get(self, name: str) -> torch.Tensor:
        """The archived rows of ``name`` ``[B, G, m, ...]`` in archive order (a copy); ``"values"`` on MLA rows is
        the latent part of each row."""
        rows = self.rows
        if name == "values" and "values" not in rows.buffers:
            geometry = self.runtime.geometry
            return self.get("keys")[..., : geometry.content_dim]
        return gather_rows(rows.buffers[name], self.positions.get("pos"))

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every archived row's key, value (GQA), slot and valid flag, ``[B, G, m, ...]`` in archive order."""
        if not self.rows.buffers or not self.n:
            return {}
        return {name: self.get(name) for name in ARCHIVED_FIELDS if name in self.rows.buffers}

    def nbytes(self, names: tuple[str, ...] = ("keys", "values", "slots")) -> int:
        rows = self.rows
        if not rows.buffers:
            return 0
        B, G = rows.buffers["keys"].shape[:2]
        per = sum(buf[0, 0, 0].numel() * buf.element_size() for name, buf in rows.buffers.items()
                  if name in names and buf.shape[2])
        return B * G * self.n * per


__all__ = ["LayerArchive", "LayerStorage", "StorageHost"]
