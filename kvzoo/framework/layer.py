"""One attention layer of a ``TieredCache`` as one object (:class:`KVLayer`): its rows, the two views over them --
the attended tier and the archive --, the retriever's index over the archive, and its counters.

A row is written once, where it lands in the layer's storage (``rows``: the key, the value on GQA, the slot, the
valid flag and the policy's per-row statistics), and never moves afterwards:

* **with an archive** (``policy.archive``: by default whenever the policy names a retriever, which reads it) the
  storage keeps every row the layer has seen, in the order they came (a row's position is its slot). The attended
  tier is the whole storage until the first eviction; from then on it is a list of positions (``tier``), and the
  archive is the list of the positions evicted (``archived``), in eviction order -- the order of the retriever's
  index entries. Evicting edits the lists; a decode step reads the tier and the fetched rows where they lie (the
  decode op takes positions);
* **without an archive** (an eviction-only policy, or ``archive=False``: evicted rows are dropped and counted) the
  storage holds the attended tier alone: a compression event keeps the selected rows at the front (memory is given
  back then), and a per-step "one in, one out" leaves a hole that the next row is written into.

Which rows go where is decided by the runtime (``framework/runtime.py``), which the layer reaches only through the
:class:`Host` protocol (the policy's settings it reads, four calls); this object holds the rows, the views and the
mechanics of moving an index, and honours transformers' cache-layer contract (``update``, ``get_seq_length``,
``get_mask_sizes``). It names no concrete policy.
"""

from __future__ import annotations

import contextvars
import weakref
from typing import Any, Protocol

import torch
from transformers.cache_utils import CacheLayerMixin

from kvzoo.framework.buffers import RowStore, gather_rows
from kvzoo.framework.retriever import ArchiveView
from kvzoo.framework.stats import LayerStats
from kvzoo.kernels.attention import received_attention
from kvzoo.kernels.decode_attention import Rows


class Host(Protocol):
    """What a layer asks of the cache runtime that holds it (``kvzoo.framework.runtime.Runtime``, which imports this
    module: the layer names only this interface, so no import runs back up). The policy and geometry it reads, the
    forward's pending layer, the cache-wide resident count, and four calls: the rows it holds changed, an event to
    fire, a new retrieval index, its statistics."""

    policy: Any
    geometry: Any
    num_layers: int
    pending: int | None
    resident: int

    @property
    def accumulates(self) -> bool: ...

    def held(self, change: int) -> None: ...

    def fire(self, layer: KVLayer, event: Any) -> None: ...

    def new_index(self) -> Any: ...

    def layer_stats(self, layer: KVLayer) -> LayerStats: ...

# transformers < 5.3 (the kvpress environment's) does not hand a layer's ``update`` the attention call's keyword
# arguments: there the layer whose ``update`` ran last in this context is kept here for kvzoo's attention to find.
ACTIVE_LAYER: contextvars.ContextVar[Any] = contextvars.ContextVar("kvzoo_active_layer", default=None)
EMPTY = {"valid": False, "slots": -1}  # what a storage row past the live ones holds: never readable, no slot
NO_ROW = {"pos": -1}  # a position list's spare entries: no row (the decode op never reads a position < 0)
ARCHIVED_FIELDS = ("keys", "values", "slots", "valid")  # what an archived row keeps (its statistics stop counting)


class KVLayer(CacheLayerMixin):
    """One layer's rows, its views, its index and its counters (module docstring).

    ``keys``, ``values``, ``slots``, ``valid`` and ``row_stats`` are snapshots of the attended tier in sequence order
    (copies, safe to keep); ``archive`` reads the archived rows (:class:`ArchivedRows`).
    """

    is_compileable = False
    is_croppable = False
    is_sliding = False
    owner: Any = None  # the model's attention module of this layer (a weakref, set by TieredCache)

    def __init__(self, runtime: Host, layer_idx: int, rank: int, *, reserve_rows: int | None = None,
                 decompress_min_queries: int | None = None, auto_compress: bool = True) -> None:
        self.runtime = runtime
        self.layer_idx = layer_idx
        self.rank = rank  # index among the layers kvzoo compresses (Kimi Linear: its MLA layers only)
        self.reserve_rows = reserve_rows
        self.decompress_min_queries = decompress_min_queries  # MLA: from this many queries a forward decompresses
        self.auto_compress = auto_compress
        self.reset()

    def reset(self) -> None:
        """Empty the layer (its rows, views, index and counters): ``TieredCache.close()``."""
        runtime = self.runtime
        if getattr(self, "is_initialized", False):
            runtime.held(-self.n)
        self.is_initialized = False
        self.refused: str | None = None  # why the cache stopped taking forwards (another model's reached it)
        # the keys update() handed the model (identity-checked by the attention), held weakly: a buffer the layer
        # reallocates (a compression that shrinks it) must not stay alive here
        self._returned: weakref.ref | None = None
        self.retains = bool(runtime.policy.archive)  # evicted rows stay in the storage (the archive)
        self.rows = RowStore()  # the storage: "keys", "values" (GQA), "slots", "valid", "stat:<name>"
        self.tier = RowStore()  # with an archive, after the first eviction: "pos", the tier's positions in rows
        self.archived = RowStore()  # with an archive: "pos", the archived rows' positions, in eviction order
        self.gathered = False  # the tier is the position list (else the storage's live rows)
        self.index = runtime.new_index()  # the retriever's state over the archive (None without a retriever)
        # counters (rows per sequence and KV group)
        self.seen = 0  # rows appended: the true sequence length
        self.seen_dev: torch.Tensor | None = None  # the same on the device, int64 [1]: a decode row's slot
        self.since_event = 0  # rows appended since the last compression event
        self.new_rows = 0  # rows appended by the forward in flight
        self.dropped_rows = 0
        self.events = 0
        self.selections = 0  # events that ran the selector over the tier (all but a one-in-one-out step)
        self.peak_rows = 0  # most rows the tier held (right after an append)
        # every row appended is known to be valid (no padding); a decode step's mask cannot be checked without a host
        # sync, so a forward that carries one clears this
        self.all_valid = True
        self.context_ended = False  # the context_end event fired (compress(), or the prompt's end in generate)
        self.budget: int | None = None  # fixed at the first event
        self.scaling: float | None = None  # the attention's softmax scale (for the observation window)
        self.window_queries: torch.Tensor | None = None  # [B, H, w, D], the latest queries (until the context ends)
        # the "inputs" observation since the last event: the attention module (a weak reference) and its inputs
        self.inputs: dict[str, Any] = {}
        self.policy_info: dict[str, Any] = {}  # the policy's and the retriever's counters
        # what the forwards read (host numbers, one add each per forward; bytes are derived by stats())
        self.tier_rows_read = 0  # tier rows attended, summed over forwards
        self.index_bytes_scanned = 0  # index bytes scanned, summed over forwards
        self.retrieval_steps = 0  # forwards that read the retrieval tier
        self.rows_scanned = 0  # index entries they scanned (over the batch and groups)
        self.fetched_rows = torch.zeros((), dtype=torch.long)  # rows fetched from the archive, on the rows' device
        self.last_read: dict[str, Any] = {}  # the latest forward's reads (stats() derives its bytes)

    def continue_as(self, *, capacity: int | None = None) -> None:
        """This layer -- a copy whose policy changed (``TieredCache.fork_as``, ``transplant``), before any event --
        continues under its runtime's policy: an empty index of the new retriever, the per-row statistics the new
        policy keeps, the archive's position lists if it keeps one, and (``capacity``) storage preallocated for that
        many rows."""
        runtime = self.runtime
        self.index = runtime.new_index()
        self.retains = bool(runtime.policy.archive)
        self.budget = None
        if not self.is_initialized:
            return
        B, G = self.batch_groups
        stats = {"stat:attention"} if runtime.accumulates else set()
        for name in [n for n in self.rows.buffers if n.startswith("stat:") and n not in stats]:
            del self.rows.buffers[name]
        for name in stats - set(self.rows.buffers):
            self.rows.add_field(name, (), torch.float32, fill=0.0)
        if capacity is not None:
            self.rows.fix(max(capacity, self.rows.n), EMPTY)
        if self.retains:
            for view in (self.tier, self.archived):
                if not view.buffers:
                    view.define(B, G, {"pos": ((), torch.long)}, self.device, fixed=self.rows.fixed, empty=NO_ROW)
                elif capacity is not None:
                    view.fix(view.capacity, NO_ROW)

    # --- what the runtime states once ----------------------------------------------------------------
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

    num_rows = n

    @property
    def archived_rows(self) -> int:
        return self.archived.n

    def row_bytes(self) -> int:
        """Bytes of one row of one (batch, group): its key (the latent row on MLA) and its value (GQA)."""
        return sum(buf.shape[-1] * buf.element_size() for name, buf in self.rows.buffers.items()
                   if name in ("keys", "values"))

    @property
    def batch_groups(self) -> tuple[int, int]:
        return tuple(self.rows.buffers["keys"].shape[:2])  # type: ignore[return-value]

    # --- transformers' layer contract ----------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor | None) -> None:
        B, G = key_states.shape[:2]
        fields: dict[str, tuple[tuple[int, ...], torch.dtype]] = {"keys": ((key_states.shape[-1],), key_states.dtype)}
        if value_states is not None:
            fields["values"] = ((value_states.shape[-1],), value_states.dtype)
        fields.update(slots=((), torch.long), valid=((), torch.bool))
        if self.runtime.accumulates:  # H2O's accumulator, zero for a new row
            fields["stat:attention"] = ((), torch.float32)
        capacity, fixed = self.capacity, self.capacity is not None
        device = key_states.device
        self.rows.define(B, G, fields, device, capacity=capacity or self.reserve_rows or 0, fixed=fixed, empty=EMPTY)
        if self.retains:
            for view in (self.tier, self.archived):
                view.define(B, G, {"pos": ((), torch.long)}, device, fixed=fixed, empty=NO_ROW)
        self.seen_dev = torch.zeros(1, dtype=torch.long, device=device)
        self.fetched_rows = self.fetched_rows.to(device)
        self.device, self.dtype = device, key_states.dtype
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor | None, *args: Any, **kwargs: Any):
        """Append this forward's rows (``[B, G, q, D]``); return the storage (what kvzoo's attention checks it was
        handed: the attention reads the layer's own views). ``value_states`` is None for MLA layers."""
        if self.refused is not None:
            raise RuntimeError(self.refused)
        self._check_rows(key_states, value_states)
        runtime = self.runtime
        pending = runtime.pending
        if pending is not None and pending < self.layer_idx:  # an earlier layer of this forward
            raise RuntimeError(
                f"layer {pending} of this TieredCache received rows but its attention never ran through "
                "kvzoo: the model using the cache does not run kvzoo's attention. A TieredCache belongs to the model "
                "it was created for (it attaches kvzoo's attention to that model): create TieredCache(model, policy) "
                "for this model. (If the previous forward failed midway, create a new cache.)"
            )
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if key_states.shape[2] == 1 and self.auto_compress and not self.context_ended and self.seen:
            runtime.fire(self, "context_end")  # the prompt ended (generate's first decode step): compress it
        self.append(key_states, value_states)
        runtime.pending = self.layer_idx
        if isinstance(kwargs.get("kwargs"), dict):  # transformers hands the attention call's kwargs: name the layer
            kwargs["kwargs"]["kvzoo_layer"] = self
        else:  # transformers < 5.3 (kvpress's): the attention finds the layer in this context
            ACTIVE_LAYER.set(self)
        keys = self.rows.buffers["keys"]
        self._returned = weakref.ref(keys)
        return keys, (self.rows.buffers["values"] if value_states is not None else None)

    @property
    def returned_keys(self) -> torch.Tensor | None:
        """The keys the last :meth:`update` handed the model, while they are alive."""
        return self._returned() if self._returned is not None else None

    def _check_rows(self, key_states: torch.Tensor, value_states: torch.Tensor | None) -> None:
        layout = self.runtime.geometry.layout
        known = self.rows.buffers.get("keys")
        if (value_states is None) != (layout == "mla") or (
                known is not None and (key_states.shape[1], key_states.shape[-1]) != (known.shape[1], known.shape[-1])):
            got = "latent rows (MLA)" if value_states is None else f"keys and values of {key_states.shape[1]} KV heads"
            raise RuntimeError(
                f"layer {self.layer_idx} of this TieredCache was built for {'an MLA' if layout == 'mla' else 'a GQA'} "
                f"model and received {got} of width {key_states.shape[-1]}: a TieredCache belongs to the model it was "
                "created for; create TieredCache(model, policy) for this model"
            )
        if known is not None and key_states.dtype != known.dtype:
            raise RuntimeError(
                f"layer {self.layer_idx} of this TieredCache holds {known.dtype} rows and received {key_states.dtype} "
                "rows: the model's dtype changed after the cache was filled (e.g. model.to(torch.bfloat16) between "
                "prefill and decode). Keep the model's dtype while a cache is in use, or create a new TieredCache"
            )

    def get_mask_sizes(self, query_length: int, *args: Any) -> tuple[int, int]:
        # Masks are sized by the true sequence length; the attention maps rows to columns by slot.
        return self.seen + query_length, 0

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1

    def get_max_cache_shape(self) -> int:  # the layer contract of transformers < 5.3 (kvpress's): unbounded
        return -1

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.batch_select_indices(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep batch elements ``indices`` (beam reordering): rows, views and the index move together."""
        if not self.is_initialized:
            return
        idx = indices.to(self.device)
        for store in (self.rows, self.tier, self.archived):
            if store.buffers:
                store.select_batch(idx)
        if self.window_queries is not None:
            self.window_queries = self.window_queries.index_select(0, idx)
        if self.index is not None:
            self.index.select_batch(idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if not self.is_initialized:
            return
        for store in (self.rows, self.tier, self.archived):
            if store.buffers:
                store.repeat_batch(repeats)
        if self.window_queries is not None:
            self.window_queries = self.window_queries.repeat_interleave(repeats, dim=0)
        if self.index is not None:
            self.index.repeat_batch(repeats)

    def crop(self, tokens_to_remove: int) -> None:
        raise RuntimeError(
            "TieredCache cannot be cropped (assisted/speculative decoding rolls back rows that may already "
            "be archived); use greedy or sampling generation"
        )

    def check_owner(self, module: torch.nn.Module, *, appended: bool) -> None:
        """Refuse (RuntimeError) a forward of ``module`` unless it is this layer's attention module in the model the
        cache was built for: another model, even of the same architecture, would attend over rows it never wrote.
        ``appended``: the forward's rows already went in (GQA's ``update`` runs before the attention); the cache then
        refuses every later forward until it is reset (``close()``)."""
        owner = self.owner() if self.owner is not None else None
        if owner is None or owner is module:
            return
        message = (
            f"layer {self.layer_idx} of this TieredCache was reached by a forward of another model's attention "
            f"({type(module).__name__} at {id(module):#x}, not the {type(owner).__name__} of the model of "
            f"{self.runtime.num_layers} attention layers the cache was built for): a TieredCache belongs to the model "
            "it was created for; create TieredCache(model, policy) for this model"
        )
        if appended:
            message += (". This cache took that forward's rows before the check and can no longer be used: create a "
                        "new one (close() empties it for reuse)")
            self.refused = message
        raise RuntimeError(message)

    def fire(self, event: str) -> None:
        self.runtime.fire(self, event)

    def stats(self) -> LayerStats:
        return self.runtime.layer_stats(self)

    # --- appending -----------------------------------------------------------------------------------
    def append(self, keys: torch.Tensor, values: torch.Tensor | None) -> None:
        """Write one forward's rows ``[B, G, q, D]`` where they land, valid until marked padding.

        A decode step's row takes its slot (and, in the position list, its position) from ``seen_dev``: no Python
        number that changes from step to step reaches an op.
        """
        B, G, q = keys.shape[:3]
        rows: dict[str, Any] = {"keys": keys, "valid": True}
        if values is not None:
            rows["values"] = values
        if q == 1:
            slots = self.seen_dev.view(1, 1, 1).expand(B, G, 1)
        else:
            slots = torch.arange(self.seen, self.seen + q, device=keys.device).expand(B, G, q)
        rows["slots"] = slots
        for name in self.rows.buffers:
            if name.startswith("stat:"):
                rows[name] = 0.0
        self.rows.append(rows, count=q)
        if self.gathered:  # with an archive a row's position is its slot
            self.tier.append({"pos": slots}, count=q)
        self.seen += q
        if q == 1:
            self.seen_dev.add_(1)
        else:
            self.seen_dev.fill_(self.seen)
        self.since_event += q
        self.new_rows = q
        self.peak_rows = max(self.peak_rows, self.n)
        self.runtime.held(q)

    def mark_padding(self, padding_mask: torch.Tensor | None) -> None:
        """Set the validity of the rows the forward in flight appended, from the 2-D padding mask ``[B, seen]``
        (True = real token). A multi-token forward checks the new rows on the host; a decode step only writes the
        flag (no host sync), and its attention honours it."""
        q = self.new_rows
        if padding_mask is None or q == 0:
            return
        valid = self.rows.buffers["valid"]
        if q == 1:  # written where the row went (found on the device)
            B, G = valid.shape[:2]
            new = padding_mask[:, -1:].to(torch.bool)  # [B, 1]
            valid.scatter_(2, self.rows.last_index(), new[:, None, :].expand(B, G, 1))
            self.all_valid = False
            return
        n = self.rows.n
        new = padding_mask[:, self.seen - q : self.seen].to(torch.bool)  # [B, q]
        self.rows.get("valid")[:, :, n - q : n] = new[:, None, :]
        if not bool(new.all()):
            self.all_valid = False

    # --- the attended tier -----------------------------------------------------------------------------
    def get(self, name: str) -> torch.Tensor:
        """The tier's live rows of ``name`` ``[B, G, n, ...]`` in tier order: a view of the storage, or (a gathered
        tier) a copy. ``"values"`` on MLA rows is the latent part of each row."""
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
        """The attended tier as one source of the decode op, read in place: the storage's live rows (with a fixed
        capacity its whole buffers and the live count on the device), or the storage at the tier's positions."""
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
                    length=length, pool_valid=valid if valid is not None else None)

    def accumulate(self, mass: torch.Tensor) -> None:
        """Add each tier row's probability in this decode step (``mass [B, H, N']`` over the positions of
        :meth:`source`), summed over its group's query heads, to its ``stat:attention`` (H2O's accumulator)."""
        stat = self.rows.buffers["stat:attention"]
        per_group = received_attention(mass, stat.shape[1])  # [B, G, N']
        if self.gathered:
            positions = self.tier.reading("pos")  # spare entries (-1) carry no mass
            stat.scatter_add_(2, positions.clamp(min=0), per_group)
        else:
            stat[:, :, : per_group.shape[-1]] += per_group

    def accumulate_rows(self, per_group: torch.Tensor) -> None:
        """Add ``per_group [B, G, n]`` (one number per tier row, in tier order) to the rows' ``stat:attention``."""
        stat = self.rows.buffers["stat:attention"]
        if self.gathered:
            stat.scatter_add_(2, self.tier.get("pos"), per_group)
        else:
            stat[:, :, : self.n] += per_group

    # --- eviction -------------------------------------------------------------------------------------
    def keep(self, keep: torch.Tensor) -> None:
        """A compression event: the tier keeps rows ``keep [B, G, k]`` (sorted tier indices); the others leave --
        to the archive (indexed first) or dropped."""
        n, k = self.n, keep.shape[2]
        self.runtime.held(k - n)
        if not self.retains:
            self.rows.keep(keep)
            self.dropped_rows += n - k
        else:
            self._gather_tier()
            leaving = self.tier.gather(self.tier.complement(keep), ("pos",))["pos"]  # [B, G, n - k], in tier order
            self._archive(leaving)
            self.tier.keep(keep)
        self.selections += 1

    def evict_one(self, victim: torch.Tensor) -> None:
        """One in, one out: tier row ``victim[b, g]`` (int64 ``[B, G]``) leaves; the next appended row takes its place
        in the tier (no row moves)."""
        self.runtime.resident -= 1  # Runtime.held(-1): one row less can raise no peak
        if not self.retains:
            self.rows.vacate(victim)
            self.dropped_rows += 1
            return
        self._gather_tier()
        self._archive(self.tier.buffers["pos"].gather(2, victim[..., None]))  # an index out of range fails here
        self.tier.vacate(victim)

    def _gather_tier(self) -> None:
        """The first eviction of a layer with an archive: the tier becomes the list of its positions (all so far)."""
        if self.gathered:
            return
        B, G = self.batch_groups
        n = self.rows.n
        if self.tier.fixed:
            self.tier.resize(self.capacity or n)
        self.tier.append({"pos": torch.arange(n, device=self.device).expand(B, G, n)}, count=n)
        self.gathered = True

    def _archive(self, positions: torch.Tensor) -> None:
        """Rows at ``positions [B, G, k]`` leave the tier for the archive: indexed (the tier still holds them),
        then listed."""
        archived = self.archived
        if archived.fixed and archived.capacity == 0:  # the first eviction: room for every row
            archived.resize(self.capacity)
        storage = self.rows.buffers
        if self.index is not None and not self.index.index_in_place(storage, positions):  # else: gathered
            leaving = {name: gather_rows(storage[name], positions) for name in ("keys", "valid")}
            self.index.index(leaving, self.tier_view(), self.archive_view())
        archived.append({"pos": positions})

    # --- the archive -----------------------------------------------------------------------------------
    def tier_view(self) -> ArchiveView:
        """The tier's rows as an :class:`ArchiveView` (read when asked: a retriever fitting its basis reads them)."""
        return ArchiveView(read=self.get, rows=self.n, groups=self.batch_groups[1])

    def archive_view(self, *, whole: bool = False, step: bool = False) -> ArchiveView:
        """The archived rows, in archive order, as an :class:`ArchiveView` (gathered from the storage when read).

        ``whole``: a fixed-capacity archive's whole list (a decode step's fixed shapes; positions past the live
        ones are not rows and read as padding). ``step``: a decode step's view, with the archive list
        (``positions``), the layer's fetched-rows counter (``fetched``) for a choice made by one op, and, where the
        policy archives the step's own row next (``Policy.own_row_archived_next``), that row where it lies
        (``own_row``: the storage and the latest append's position)."""
        archived = self.archived
        rows = archived.capacity if (whole and archived.fixed) else archived.n
        extra = {}
        if step:
            extra = {"positions": archived.reading("pos") if whole else archived.get("pos"),
                     "fetched": self.fetched_rows}
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

        return ArchiveView(read=read, budget=self.budget, rows=rows, groups=self.rows.buffers["keys"].shape[1],
                           **extra)

    @property
    def archive(self) -> ArchivedRows:
        return ArchivedRows(self)

    # --- snapshots of the tier, in sequence order ---------------------------------------------------------
    def _ordered(self, name: str) -> torch.Tensor | None:
        if not self.is_initialized or (name not in self.rows.buffers and name != "values"):
            return None
        if name == "values" and "values" not in self.rows.buffers:
            return None
        self.ensure_order()
        return self.get(name).clone()

    @property
    def keys(self) -> torch.Tensor | None:
        return self._ordered("keys")

    @property
    def values(self) -> torch.Tensor | None:
        return self._ordered("values")

    @property
    def slots(self) -> torch.Tensor | None:
        return self._ordered("slots")

    @property
    def valid(self) -> torch.Tensor | None:
        return self._ordered("valid")

    @property
    def row_stats(self) -> dict[str, torch.Tensor]:
        if not self.is_initialized:
            return {}
        self.ensure_order()
        return {name: stat.clone() for name, stat in self.row_statistics().items()}

    @property
    def retrieval(self):
        """The retriever's index over this layer's archive (None without a retriever)."""
        return self.index


class ArchivedRows:
    """The archived rows of a layer, read from its storage (a view: nothing is kept)."""

    def __init__(self, layer: KVLayer) -> None:
        self.layer = layer

    @property
    def n(self) -> int:
        return self.layer.archived.n

    def get(self, name: str) -> torch.Tensor:
        layer = self.layer
        if name == "values" and "values" not in layer.rows.buffers:
            return self.get("keys")[..., : layer.latent_width]
        return gather_rows(layer.rows.buffers[name], layer.archived.get("pos"))

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every archived row's key, value (GQA), slot and valid flag, ``[B, G, m, ...]`` in archive order."""
        layer = self.layer
        if not layer.is_initialized or not self.n:
            return {}
        return {name: self.get(name) for name in ARCHIVED_FIELDS if name in layer.rows.buffers}

    def nbytes(self, names: tuple[str, ...] = ("keys", "values", "slots")) -> int:
        layer = self.layer
        if not layer.is_initialized:
            return 0
        B, G = layer.batch_groups
        per = sum(buf[0, 0, 0].numel() * buf.element_size() for name, buf in layer.rows.buffers.items()
                  if name in names and buf.shape[2])
        return B * G * self.n * per


__all__ = ["ArchivedRows", "KVLayer"]
