"""``TieredCache``: a transformers ``Cache`` that holds each layer's rows in two tiers.

Per layer and sequence, every row ever appended is in exactly one place (DESIGN.md §1):

* the **attended tier** -- ``keys``/``values`` tensors that every step attends to; they really
  shrink at a compression event (new, smaller tensors; nothing is masked instead of removed);
* the **archive** -- evicted rows, bit-exact, with their slots; or, with ``archive=False``,
  nowhere, and counted in ``dropped_rows``.

The cache honours transformers' narrow cache contract (``update``, ``get_seq_length``,
``get_mask_sizes``), so ``model.generate(..., cache=cache)`` works unchanged.
``get_seq_length`` reports the *true* sequence length (rows ever seen), so positions and masks
keep counting real tokens after eviction, and decoding continues at the true position.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from kvzoo.framework.policy import Event, Policy, RowsView
from kvzoo.framework.retrieval import ArchiveView, RowGeometry, check_retriever_params, figures, row_bytes
from kvzoo.framework.store import RowStore
from kvzoo.kernels.attention import window_attention

# The layer whose ``update`` ran last in this context; the attention function picks it up and
# checks that the key tensor it was handed is that layer's attended tier (identity, not equality).
ACTIVE_LAYER: contextvars.ContextVar[TieredLayer | None] = contextvars.ContextVar("kvzoo_active_layer", default=None)


class Archive(RowStore):
    """Evicted rows of one layer, bit-exact, appended in eviction order: ``keys``, ``values`` (GQA),
    ``slots``, ``valid`` (a :class:`~kvzoo.framework.store.RowStore` that only grows)."""

    @property
    def num_rows(self) -> int:
        return self.n

    @property
    def nbytes(self) -> int:
        return self.nbytes_of(("keys", "values", "slots"))

    def nbytes_of(self, names: tuple[str, ...]) -> int:
        return RowStore.nbytes(self, names)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The archived rows per buffer, ``[B, G, m, ...]`` views (empty dict when nothing is archived)."""
        return {name: self.get(name) for name in self.buffers} if self.n else {}


class TieredLayer(CacheLayerMixin):
    """One layer's attended tier, archive and policy state.

    The tier lives in preallocated buffers (:class:`~kvzoo.framework.store.RowStore`) that later
    steps write in place. ``keys``, ``values``, ``slots``, ``valid`` and ``row_stats`` are snapshots
    of the live rows in sequence order (copies, safe to keep); the runtime reads ``tier`` directly,
    whose rows may be out of order between per-step evictions.
    """

    is_compileable = False
    is_croppable = False
    is_sliding = False

    def __init__(self, cache: TieredCache, layer_idx: int, layer_rank: int | None = None) -> None:
        self.is_initialized = False
        self.cache = cache
        self.layer_idx = layer_idx
        # index among the layers kvzoo compresses (Kimi Linear: MLA layers only); fixed at construction
        self.layer_rank = layer_idx if layer_rank is None else layer_rank
        self.tier = RowStore()  # "keys", "values" (GQA), "slots", "valid", "stat:<name>"
        self.archive = Archive()
        self.seen = 0  # rows appended per (batch, group): the true sequence length
        self.since_event = 0  # rows appended since this layer's last event
        self.new_rows = 0  # rows appended by the forward pass in flight
        self.dropped_rows = 0
        self.events = 0
        self.budget: int | None = None  # fixed at the first event
        self.scaling: float | None = None
        self.window_queries: torch.Tensor | None = None  # [B, H, w, D], the latest queries
        self.fetched_rows: int | torch.Tensor = 0  # a device tensor once rows are fetched (read by stats())
        # bytes every forward's attention read (host arithmetic): the attended tier at attention time,
        # and the index entries scanned; with the fetched rows' bytes they make kv_bytes_read
        self.attended_bytes_read = 0
        self.index_bytes_scanned = 0
        self.policy_info: dict[str, Any] = {}  # counters the policy reports (RowsView.info); tensors allowed
        # every row appended so far is known to be valid (no padding); single-token forwards that
        # carry a mask cannot be checked without a host sync, so they clear it
        self.all_valid = True
        self.peak_rows = 0  # most rows the attended tier ever held (right after an append)
        self.returned_keys: torch.Tensor | None = None  # the view update() handed the model
        geometry = RowGeometry(
            cache.adapter.layout, getattr(cache.adapter, "kv_lora_rank", 0), getattr(cache.adapter, "rope_dim", 0)
        )
        # the retriever's per-layer state (index over this layer's archive), or None
        self.retrieval = cache.retriever.new_state(geometry) if cache.retriever is not None else None
        self.last_step: dict[str, Any] = {}  # the latest forward's KV-path accounting

    # --- the live rows, in sequence order --------------------------------------------------------
    def _ordered(self, name: str) -> torch.Tensor | None:
        if not self.is_initialized or name not in self.tier:
            return None
        self.tier.ensure_order()
        return self.tier.get(name).clone()

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
        self.tier.ensure_order()
        return {name: stat.clone() for name, stat in self._stats().items()}

    def _stats(self) -> dict[str, torch.Tensor]:
        return {name[5:]: self.tier.get(name) for name in self.tier.buffers if name.startswith("stat:")}

    # --- transformers' layer contract --------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor | None) -> None:
        B, G, _, D = key_states.shape
        self.device = key_states.device
        self.dtype = key_states.dtype
        fields: dict[str, tuple[tuple[int, ...], torch.dtype]] = {"keys": ((D,), key_states.dtype)}
        # MLA rows carry keys and values in one latent row: no separate value tensor
        if value_states is not None:
            fields["values"] = ((value_states.shape[-1],), value_states.dtype)
        fields.update(slots=((), torch.long), valid=((), torch.bool))
        self.archive.define(B, G, fields, self.device)
        for name in self.cache.policy.new_row_stats():
            fields[f"stat:{name}"] = ((), torch.float32)
        self.tier.define(B, G, fields, self.device, capacity=self.cache.reserve_rows or 0)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor | None, *args: Any, **kwargs: Any):
        """Append this forward's rows (``[B, G, q, D]``) to the attended tier; return the tier.

        ``value_states`` is None for MLA layers, whose latent row serves as key and value.
        """
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        q = key_states.shape[2]
        rows: dict[str, Any] = {"keys": key_states, "valid": True}
        if value_states is not None:
            rows["values"] = value_states
        # slots: one scalar fill for a decode step, a range for a prefill chunk
        rows["slots"] = self.seen if q == 1 else torch.arange(self.seen, self.seen + q, device=self.device)
        for name in self.tier.buffers:
            if name.startswith("stat:"):
                rows[name] = 0.0
        self.tier.append(rows, count=q)
        self.seen += q
        self.since_event += q
        self.new_rows = q
        self.peak_rows = max(self.peak_rows, self.tier.n)
        ACTIVE_LAYER.set(self)
        self.returned_keys = self.tier.get("keys")
        return self.returned_keys, (self.tier.get("values") if value_states is not None else None)

    def value_rows(self) -> torch.Tensor:
        """What attention reads as values: ``values`` (GQA) or the latent part ``c`` of MLA rows (a view)."""
        if "values" in self.tier:
            return self.tier.get("values")
        return self.tier.get("keys")[..., : self.cache.adapter.kv_lora_rank]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # Masks are sized by true sequence length; the attention function maps rows to columns by slot.
        return self.seen + query_length, 0

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.__init__(self.cache, self.layer_idx, self.layer_rank)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.batch_select_indices(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if not self.is_initialized:
            return
        idx = indices.to(self.device)
        self.tier.select_batch(idx)
        self.archive.select_batch(idx)
        if self.window_queries is not None:
            self.window_queries = self.window_queries.index_select(0, idx)
        if self.retrieval is not None:
            self.retrieval.select_batch(idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if not self.is_initialized:
            return
        self.tier.repeat_batch(repeats)
        self.archive.repeat_batch(repeats)
        if self.window_queries is not None:
            self.window_queries = self.window_queries.repeat_interleave(repeats, dim=0)
        if self.retrieval is not None:
            self.retrieval.repeat_batch(repeats)

    def crop(self, tokens_to_remove: int) -> None:
        raise RuntimeError(
            "TieredCache cannot be cropped (assisted/speculative decoding rolls back rows that may already "
            "be archived); use greedy or sampling generation"
        )

    # --- bookkeeping the attention function calls ---------------------------------------------
    @property
    def num_rows(self) -> int:
        return self.tier.n

    def mark_padding(self, padding_mask: torch.Tensor | None) -> None:
        """Set ``valid`` of the rows appended by this forward from the 2-D padding mask.

        ``padding_mask`` is ``[B, seen]`` bool over slots (True = real token), or None (no padding).
        A multi-token forward checks the new rows on the host (prefill may synchronise); a decode
        step only writes the flags, and its attention then honours them (no host sync per step).
        """
        q = self.new_rows
        if padding_mask is None or q == 0:
            return
        new = padding_mask[:, self.seen - q : self.seen].to(torch.bool)  # [B, q]
        n = self.tier.n
        self.tier.get("valid")[:, :, n - q : n] = new[:, None, :]
        if q == 1 or not bool(new.all()):
            self.all_valid = False

    def record_queries(self, query: torch.Tensor | None, window: int) -> None:
        """Keep the latest ``window`` queries ``[B, H, w, D]`` (for observation-window attention)."""
        if window <= 0 or query is None:
            return
        query = query[:, :, -window:]
        joined = query if self.window_queries is None else torch.cat([self.window_queries, query], dim=2)
        self.window_queries = joined[:, :, -window:].detach()

    def view(self, ordered: bool = True) -> RowsView:
        """The attended tier as a :class:`RowsView` for the selector (``ordered=False``: as stored)."""
        if ordered:
            self.tier.ensure_order()
        tier = self.tier
        keys, slots, valid = tier.get("keys"), tier.get("slots"), tier.get("valid")
        policy = self.cache.policy
        window_fn = None
        if "window" in policy.observes and self.window_queries is not None:
            queries = self.window_queries
            q_slots = torch.arange(self.seen - queries.shape[2], self.seen, device=self.device)
            scaling = self.scaling

            def window_fn() -> torch.Tensor:  # w x n, computed only if the selector reads it
                return window_attention(queries, q_slots, keys, slots, valid, scaling)

        return RowsView(
            keys=keys,
            values=tier.get("values") if "values" in tier else None,
            slots=slots,
            valid=valid,
            layer_idx=self.layer_idx,
            num_layers=self.cache.num_tiered,
            layout=self.cache.adapter.layout,
            layer_rank=self.layer_rank,
            branch_dim=getattr(self.cache.adapter, "rope_dim", 0),
            first_new=max(0, self.tier.n - self.since_event),
            window_fn=window_fn,
            row_stats=self._stats(),
            shared=self.cache.policy_shared,
            info=self.policy_info,
        )

    # --- events -------------------------------------------------------------------------------
    def after_forward(self) -> None:
        """Fire this forward's scheduled event, if the policy has one."""
        policy = self.cache.policy
        self.new_rows = 0
        if policy.schedule == "step":
            self.fire("step")
        elif policy.schedule == "block" and policy.block_size and self.since_event >= policy.block_size:
            self.fire("block")

    def fire(self, event: Event) -> None:
        """Run the policy's selector for ``event`` and move the rows it does not keep."""
        if not self.is_initialized:
            return
        policy = self.cache.policy
        if policy.is_dense(self.layer_rank):
            return
        n = self.tier.n
        basis = max(self.seen, self.cache.context_length or 0)  # ratio budgets count the whole context
        target = policy.target_rows(
            event, rows_seen=basis, resident=n, fixed_budget=self.budget, block_rows=min(self.since_event, n),
            seen=self.seen,
        )
        if self.budget is None:
            self.budget = policy.resolve_budget(basis)
        if target is None or target >= n:
            self.since_event = 0
            return
        if event == "step" and target == n - 1:  # one in, one out: O(1) rows move when the policy can say which
            victim = policy.step_victim(self.view(ordered=False))
            if victim is not None:
                self.since_event = 0
                self._remove_one(victim)
                self.events += 1
                return
        rows = self.view()  # before since_event resets: the view marks where the closed block starts
        self.since_event = 0
        keep = policy.select(rows, target)
        self._check_keep(keep, target, n)
        self.evict_all_but(keep)
        self.events += 1

    def _check_keep(self, keep: torch.Tensor, target: int, n: int) -> None:
        B, G = self.tier.get("keys").shape[:2]
        name = self.cache.policy.name
        if keep.shape != (B, G, target) or keep.dtype != torch.long:
            raise RuntimeError(
                f"policy {name!r} select() must return int64 indices of shape {(B, G, target)}, "
                f"got {keep.dtype} {tuple(keep.shape)}"
            )
        if target:  # checked on the device: no host synchronisation
            ok = (keep.min() >= 0) & (keep.max() < n) & (keep.diff(dim=-1) > 0).all()
            torch._assert_async(ok, f"policy {name!r} select() returned indices that are out of range, unsorted or repeated")

    def _archive_rows(self, rows: dict[str, torch.Tensor], count: int) -> None:
        """Move evicted ``rows`` (``[B, G, count, ...]``, tier buffers) to the archive, indexed; or drop them."""
        if not self.cache.policy.archive:
            self.dropped_rows += count
            return
        archived = {name: rows[name] for name in self.archive.buffers}
        if self.retrieval is not None:  # index the rows before they leave (the block is still whole)
            view = ArchiveView(self.archive.get("keys"), self.archive.get("slots"), self.archive.get("valid"), self.budget)
            self.retrieval.index(archived, self.tier.get("keys"), self.tier.get("valid"), view)
        self.archive.append(archived)

    def evict_all_but(self, keep: torch.Tensor) -> None:
        """Keep rows ``keep [B, G, k]`` (sorted) attended; archive or drop the others."""
        evicted = self.tier.complement(keep)
        if self.cache.policy.archive:
            self._archive_rows(self.tier.gather(evicted, tuple(self.archive.buffers)), evicted.shape[2])
        else:
            self.dropped_rows += evicted.shape[2]
        self.tier.keep(keep)

    def _remove_one(self, victim: torch.Tensor) -> None:
        B, G = self.tier.get("keys").shape[:2]
        if victim.shape != (B, G) or victim.dtype != torch.long:
            raise RuntimeError(
                f"policy {self.cache.policy.name!r} step_victim() must return int64 indices of shape {(B, G)}, "
                f"got {victim.dtype} {tuple(victim.shape)}"
            )
        # an index out of range fails in the gather below (no separate check on this per-step path)
        if self.cache.policy.archive:
            self._archive_rows(self.tier.gather(victim[..., None], tuple(self.archive.buffers)), 1)
        else:
            self.dropped_rows += 1
        self.tier.remove_one(victim)

    def stats(self) -> LayerStats:
        names = ("keys", "values")
        fetched = _number(self.fetched_rows)
        info = {k: _number(v) for k, v in self.policy_info.items()}
        fetched_bytes = fetched * row_bytes(self) if fetched else 0
        if "retrieval_steps" in info:  # cumulative reads of the retrieval tier, derived here from the counts
            info.update(rows_fetched=fetched, fetched_bytes=fetched_bytes, attended_bytes_read=self.attended_bytes_read,
                        index_bytes_scanned=self.index_bytes_scanned)
        return LayerStats(
            layer=self.layer_idx,
            seen_rows=self.seen,
            resident_rows=self.tier.n,
            peak_resident_rows=self.peak_rows,
            resident_bytes=self.tier.nbytes(names) if self.is_initialized else 0,
            archived_rows=self.archive.num_rows,
            archived_bytes=self.archive.nbytes,
            dropped_rows=self.dropped_rows,
            events=self.events,
            fetched_rows=fetched,
            kv_bytes_read=self.attended_bytes_read + self.index_bytes_scanned + fetched_bytes,
            policy_info=info,
            last_step={k: _number(v) for k, v in figures(self.last_step).items()},
        )


def _number(value: Any) -> float:
    """A counter as a Python number (device tensors are read here, outside the decode step)."""
    if isinstance(value, torch.Tensor):
        value = value.item()
    return int(value) if float(value).is_integer() else float(value)


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
    last_step: dict[str, float] = field(default_factory=dict)  # the latest forward's retrieval figures


@dataclass
class CacheStats:
    policy: dict[str, Any]
    layers: list[LayerStats] = field(default_factory=list)

    @property
    def totals(self) -> dict[str, float]:
        """Sums over layers of every counter, the policy's own counters included."""
        skip = ("layer", "policy_info", "last_step", "peak_resident_rows")
        keys = [k for k in LayerStats.__dataclass_fields__ if k not in skip]
        out: dict[str, float] = {k: sum(getattr(s, k) for s in self.layers) for k in keys}
        out["peak_resident_rows"] = max((s.peak_resident_rows for s in self.layers), default=0)  # per layer, max
        for s in self.layers:
            for k, v in s.policy_info.items():
                out[k] = out.get(k, 0) + v
        return out

    def as_dict(self) -> dict[str, Any]:
        return {"policy": self.policy, "totals": self.totals, "layers": [vars(s) for s in self.layers]}

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
        return head + "\n" + "\n".join(rows)


class TieredCache(Cache):
    """A two-tier KV cache driven by a kvzoo policy. Drop-in for ``model.generate``.

    >>> cache = TieredCache(model, registry.get("streaming_llm", ratio=4))
    >>> out = model.generate(**inputs, cache=cache, max_new_tokens=32)

    Creating the cache attaches kvzoo's attention to ``model`` (``kvzoo.framework.runtime.attach``);
    with any other cache that attention behaves exactly like SDPA. Policies with a ``step`` or
    ``block`` schedule compress by themselves during ``generate``; a ``context_end`` compression
    happens when you call :meth:`compress` (``kvzoo.pipeline`` does it after the context).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        policy: Policy | str | None = None,
        *,
        context_length: int | None = None,
        audit: bool = False,
        decompress_min_queries: int | None = None,
    ) -> None:
        from transformers.cache_utils import LinearAttentionLayer

        from kvzoo.framework.adapters import adapter_for
        from kvzoo.framework.retrieval import build_retriever
        from kvzoo.framework.runtime import attach

        self.policy = _resolve_policy(policy)
        self.retriever = build_retriever(self.policy.retriever, **self.policy.retriever_params()) \
            if isinstance(self.policy.retriever, str) else build_retriever(self.policy.retriever)
        check_retriever_params(self.policy, self.retriever)
        if self.retriever is not None and not self.policy.archive:
            raise ValueError(
                f"policy {self.policy.name!r} has retriever={self.retriever.name!r} but archive=False: a retriever "
                "fetches from the archive; use archive=True or retriever=None"
            )
        # audit=True: every retrieval step also scores all archived rows exactly, to count bound
        # violations and the recall of the true top rows (slow: it reads the whole archive)
        self.audit = audit
        self.adapter = adapter_for(model, self.policy)
        self.adapter.attach()
        attach(model)
        self.policy_shared: dict[str, Any] = {}
        # ratio budgets are fractions of the context; with streaming prefill the pipeline says how
        # long the context will be, so the first chunk's event does not fix a budget of chunk/ratio
        self.context_length = context_length
        # a policy that never evicts (full) holds the whole context: reserve it once instead of growing
        self.reserve_rows = context_length if context_length and not self.policy.requires_budget else None
        # MLA: forwards with at least this many queries attend in decompressed per-head form (SDPA);
        # fewer (a decode step) in absorbed form over the latent rows. None: the FLOP break-even of
        # the model's geometry (``MLAAdapter.decompress_min_queries``). Ignored on GQA models.
        if decompress_min_queries is not None and (
            isinstance(decompress_min_queries, bool) or not isinstance(decompress_min_queries, int)
            or decompress_min_queries < 2
        ):
            raise ValueError(
                "decompress_min_queries must be None (the model's FLOP break-even) or an int >= 2 (a decode step "
                f"of one query always attends in absorbed form), got {decompress_min_queries!r}"
            )
        self.decompress_min_queries = decompress_min_queries
        tiered = [i for i in range(self.adapter.num_layers) if self.adapter.is_tiered(i)]
        self.num_tiered = len(tiered)
        layers = [
            TieredLayer(self, i, tiered.index(i)) if i in tiered else LinearAttentionLayer()  # Kimi's KDA layers
            for i in range(self.adapter.num_layers)
        ]
        super().__init__(layers=layers)

    @property
    def tiered_layers(self) -> list[TieredLayer]:
        """The layers kvzoo compresses, in order (all layers on GQA; the MLA layers on Kimi Linear)."""
        return [layer for layer in self.layers if isinstance(layer, TieredLayer)]

    def compress(self) -> None:
        """The context ended: fire the ``context_end`` event on every layer."""
        for layer in self.tiered_layers:
            layer.fire("context_end")

    def stats(self) -> CacheStats:
        return CacheStats(policy=self.policy.config(), layers=[layer.stats() for layer in self.tiered_layers])

    def __repr__(self) -> str:
        return f"TieredCache(policy={self.policy!r}, layers={len(self.layers)})"


def _resolve_policy(policy: Policy | str | None) -> Policy:
    if policy is None:
        from kvzoo.policies.full import Full

        policy = Full()
    elif isinstance(policy, str):
        from kvzoo import registry

        policy = registry.get(policy)
    if not isinstance(policy, Policy):
        raise TypeError(
            f"policy must be a kvzoo Policy, a registered name (see kvzoo.registry.available()) or None, "
            f"got {type(policy).__name__}"
        )
    return policy


__all__ = ["TieredCache", "TieredLayer", "CacheStats", "LayerStats", "Archive", "ACTIVE_LAYER", "window_attention"]
