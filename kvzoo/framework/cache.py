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
from kvzoo.kernels.attention import window_attention

# The layer whose ``update`` ran last in this context; the attention function picks it up and
# checks that the key tensor it was handed is that layer's attended tier (identity, not equality).
ACTIVE_LAYER: contextvars.ContextVar[TieredLayer | None] = contextvars.ContextVar("kvzoo_active_layer", default=None)


class Archive:
    """Evicted rows of one layer, bit-exact, as appended segments ``[B, G, m_i, ...]``."""

    def __init__(self) -> None:
        self.segments: list[dict[str, torch.Tensor]] = []
        self._joined: dict[str, torch.Tensor] | None = None

    def add(self, **rows: torch.Tensor) -> None:
        self.segments.append(rows)
        self._joined = None

    @property
    def num_rows(self) -> int:
        return sum(seg["slots"].shape[2] for seg in self.segments)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for seg in self.segments for k, t in seg.items() if k != "valid")

    def tensors(self) -> dict[str, torch.Tensor]:
        """All archived rows joined along the row axis (cached until the next ``add``)."""
        if self._joined is None:
            if not self.segments:
                return {}
            keys = self.segments[0].keys()
            self._joined = {k: torch.cat([seg[k] for seg in self.segments], dim=2) for k in keys}
            self.segments = [self._joined]
        return self._joined

    def select_batch(self, index: torch.Tensor) -> None:
        self.segments = [{k: t.index_select(0, index) for k, t in seg.items()} for seg in self.segments]
        self._joined = None


class TieredLayer(CacheLayerMixin):
    """One layer's attended tier, archive and policy state."""

    is_compileable = False
    is_croppable = False
    is_sliding = False

    def __init__(self, cache: TieredCache, layer_idx: int, layer_rank: int | None = None) -> None:
        super().__init__()
        self.cache = cache
        self.layer_idx = layer_idx
        # index among the layers kvzoo compresses (Kimi Linear: MLA layers only); fixed at construction
        self.layer_rank = layer_idx if layer_rank is None else layer_rank
        self.slots: torch.Tensor | None = None  # [B, G, n] int64
        self.valid: torch.Tensor | None = None  # [B, G, n] bool
        self.row_stats: dict[str, torch.Tensor] = {}  # name -> [B, G, n] fp32
        self.archive = Archive()
        self.seen = 0  # rows appended per (batch, group): the true sequence length
        self.since_event = 0  # rows appended since this layer's last event
        self.new_rows = 0  # rows appended by the forward pass in flight
        self.dropped_rows = 0
        self.events = 0
        self.budget: int | None = None  # fixed at the first event
        self.scaling: float | None = None
        self.window_queries: torch.Tensor | None = None  # [B, H, w, D], the latest queries
        self.fetched_rows = 0
        self.policy_info: dict[str, float] = {}  # counters the policy reports (RowsView.info)
        self.no_padding = True  # no padding row was ever appended (lets attention skip trivial masks)
        self.peak_rows = 0  # most rows the attended tier ever held (right after an append)
        # the retriever's per-layer state (index over this layer's archive), or None
        self.retrieval = cache.retriever.new_state(self) if cache.retriever is not None else None
        self.last_step: dict[str, float] = {}  # the latest forward's retrieval accounting

    # --- transformers' layer contract --------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor | None) -> None:
        B, G, _, D = key_states.shape
        self.device = key_states.device
        self.dtype = key_states.dtype
        self.keys = key_states.new_empty(B, G, 0, D)
        # MLA rows carry keys and values in one latent row: no separate value tensor
        self.values = None if value_states is None else value_states.new_empty(B, G, 0, value_states.shape[-1])
        self.slots = torch.empty(B, G, 0, dtype=torch.long, device=self.device)
        self.valid = torch.empty(B, G, 0, dtype=torch.bool, device=self.device)
        self.row_stats = {
            name: torch.empty(B, G, 0, dtype=torch.float32, device=self.device)
            for name in self.cache.policy.new_row_stats()
        }
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor | None, *args: Any, **kwargs: Any):
        """Append this forward's rows (``[B, G, q, D]``) to the attended tier; return the tier.

        ``value_states`` is None for MLA layers, whose latent row serves as key and value.
        """
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        B, G, q, _ = key_states.shape
        new_slots = torch.arange(self.seen, self.seen + q, device=self.device).expand(B, G, q)
        self.keys = torch.cat([self.keys, key_states], dim=2)
        if self.values is not None:
            self.values = torch.cat([self.values, value_states], dim=2)
        self.slots = torch.cat([self.slots, new_slots], dim=2)
        # valid until the attention call tells us which new rows are padding (mark_padding)
        self.valid = torch.cat([self.valid, torch.ones(B, G, q, dtype=torch.bool, device=self.device)], dim=2)
        for name, stat in self.row_stats.items():
            self.row_stats[name] = torch.cat([stat, stat.new_zeros(B, G, q)], dim=2)
        self.seen += q
        self.since_event += q
        self.new_rows = q
        self.peak_rows = max(self.peak_rows, self.num_rows)
        ACTIVE_LAYER.set(self)
        return self.keys, self.values

    def value_rows(self) -> torch.Tensor:
        """What attention reads as values: ``values`` (GQA) or the latent part ``c`` of MLA rows (a view)."""
        if self.values is not None:
            return self.values
        return self.keys[..., : self.cache.adapter.kv_lora_rank]

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
        self.keys = self.keys.index_select(0, idx)
        self.values = None if self.values is None else self.values.index_select(0, idx)
        self.slots, self.valid = self.slots.index_select(0, idx), self.valid.index_select(0, idx)
        self.row_stats = {k: v.index_select(0, idx) for k, v in self.row_stats.items()}
        if self.window_queries is not None:
            self.window_queries = self.window_queries.index_select(0, idx)
        self.archive.select_batch(idx)

    def crop(self, tokens_to_remove: int) -> None:
        raise RuntimeError(
            "TieredCache cannot be cropped (assisted/speculative decoding rolls back rows that may already "
            "be archived); use greedy or sampling generation"
        )

    # --- bookkeeping the attention function calls ---------------------------------------------
    @property
    def num_rows(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def mark_padding(self, padding_mask: torch.Tensor | None) -> None:
        """Set ``valid`` of the rows appended by this forward from the 2-D padding mask.

        ``padding_mask`` is ``[B, seen]`` bool over slots (True = real token), or None (no padding).
        """
        if padding_mask is None or self.new_rows == 0:
            return
        new = padding_mask[:, self.seen - self.new_rows : self.seen].to(torch.bool)  # [B, q]
        self.valid[:, :, -self.new_rows :] = new[:, None, :]
        if not bool(new.all()):
            self.no_padding = False

    def record_queries(self, query: torch.Tensor, window: int) -> None:
        """Keep the latest ``window`` queries ``[B, H, w, D]`` (for observation-window attention)."""
        if window <= 0:
            return
        joined = query if self.window_queries is None else torch.cat([self.window_queries, query], dim=2)
        self.window_queries = joined[:, :, -window:].detach()

    def view(self) -> RowsView:
        """The attended tier as a :class:`RowsView` for the selector."""
        policy = self.cache.policy
        window_fn = None
        if "window" in policy.observes and self.window_queries is not None:
            queries = self.window_queries
            q_slots = torch.arange(self.seen - queries.shape[2], self.seen, device=self.device)
            keys, slots, valid, scaling = self.keys, self.slots, self.valid, self.scaling

            def window_fn() -> torch.Tensor:  # w x n, computed only if the selector reads it
                return self.cache.adapter.window_attention(queries, q_slots, keys, slots, valid, scaling)

        return RowsView(
            keys=self.keys,
            values=None if self.cache.adapter.layout == "mla" else self.values,
            slots=self.slots,
            valid=self.valid,
            layer_idx=self.layer_idx,
            num_layers=len(self.cache.tiered_layers),
            layout=self.cache.adapter.layout,
            layer_rank=self.layer_rank,
            branch_dim=getattr(self.cache.adapter, "rope_dim", 0),
            first_new=max(0, self.num_rows - self.since_event),
            window_fn=window_fn,
            row_stats=self.row_stats,
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
        n = self.num_rows
        basis = max(self.seen, self.cache.context_length or 0)  # ratio budgets count the whole context
        target = policy.target_rows(
            event, rows_seen=basis, resident=n, fixed_budget=self.budget, block_rows=min(self.since_event, n)
        )
        if self.budget is None:
            self.budget = policy.resolve_budget(basis)
        if target is None or target >= n:
            self.since_event = 0
            return
        rows = self.view()  # before since_event resets: the view marks where the closed block starts
        self.since_event = 0
        keep = policy.select(rows, target)
        self._check_keep(keep, target, n)
        self.evict_all_but(keep)
        self.events += 1

    def _check_keep(self, keep: torch.Tensor, target: int, n: int) -> None:
        B, G = self.keys.shape[:2]
        name = self.cache.policy.name
        if keep.shape != (B, G, target) or keep.dtype != torch.long:
            raise RuntimeError(
                f"policy {name!r} select() must return int64 indices of shape {(B, G, target)}, "
                f"got {keep.dtype} {tuple(keep.shape)}"
            )
        if target and (keep.min() < 0 or keep.max() >= n or (keep.diff(dim=-1) <= 0).any()):
            raise RuntimeError(f"policy {name!r} select() returned indices that are out of range, unsorted or repeated")

    def evict_all_but(self, keep: torch.Tensor) -> None:
        """Keep rows ``keep [B, G, k]`` (sorted) attended; archive or drop the others."""
        n = self.num_rows
        kept_mask = torch.zeros_like(self.valid).scatter_(2, keep, True)
        # stable sort of the 0/1 mask puts evicted rows first, in sequence order
        evict = torch.sort(kept_mask.to(torch.uint8), dim=2, stable=True).indices[:, :, : n - keep.shape[2]]

        def take(t: torch.Tensor | None, idx: torch.Tensor) -> torch.Tensor | None:
            if t is None:
                return None
            if t.dim() == 4:
                return t.gather(2, idx[..., None].expand(*idx.shape, t.shape[-1]))
            return t.gather(2, idx)

        if self.cache.policy.archive:
            rows = {"keys": take(self.keys, evict), "slots": take(self.slots, evict), "valid": take(self.valid, evict)}
            if self.values is not None:
                rows["values"] = take(self.values, evict)
            if self.retrieval is not None:  # index the rows before they leave (the block is still whole)
                self.retrieval.index(self, rows, block_keys=self.keys)
            self.archive.add(**rows)
        else:
            self.dropped_rows += evict.shape[2]
        self.keys, self.values = take(self.keys, keep), take(self.values, keep)
        self.slots, self.valid = take(self.slots, keep), take(self.valid, keep)
        self.row_stats = {k: take(v, keep) for k, v in self.row_stats.items()}

    def stats(self) -> LayerStats:
        def nbytes(*ts: torch.Tensor | None) -> int:
            return sum(t.numel() * t.element_size() for t in ts if t is not None)

        return LayerStats(
            layer=self.layer_idx,
            seen_rows=self.seen,
            resident_rows=self.num_rows,
            peak_resident_rows=self.peak_rows,
            resident_bytes=nbytes(self.keys, self.values) if self.is_initialized else 0,
            archived_rows=self.archive.num_rows,
            archived_bytes=self.archive.nbytes,
            dropped_rows=self.dropped_rows,
            events=self.events,
            fetched_rows=self.fetched_rows,
            policy_info=dict(self.policy_info),
            last_step=dict(self.last_step),
        )


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
    ) -> None:
        from transformers.cache_utils import LinearAttentionLayer

        from kvzoo.framework.adapters import adapter_for
        from kvzoo.framework.retrieval import build_retriever
        from kvzoo.framework.runtime import attach

        self.policy = _resolve_policy(policy)
        self.retriever = build_retriever(self.policy.retriever)
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
        tiered = [i for i in range(self.adapter.num_layers) if self.adapter.is_tiered(i)]
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
