"""One attention layer of a ``TieredCache`` (:class:`KVLayer`): the part transformers calls, wiring its storage
(``store``, :class:`~kvzoo.framework.storage.LayerStorage`) and counters (``counts``) with the event state the
runtime keeps per layer. It honours transformers' cache-layer contract, refuses forwards of a model it was not
built for, and reaches the runtime only through the :class:`Host` protocol (no import runs back up).
"""

from __future__ import annotations

import contextvars
import weakref
from typing import Any, Protocol

import torch
from transformers.cache_utils import CacheLayerMixin

from kvzoo.framework.observed import Observed
from kvzoo.framework.policy import RowsView, observed_rows
from kvzoo.framework.stats import LayerCounters
from kvzoo.framework.storage import EMPTY, LayerStorage, StorageHost


class Host(StorageHost, Protocol):
    """What a layer asks of the cache runtime that holds it (``kvzoo.framework.runtime.Runtime``): its storage's part
    (:class:`StorageHost`), the forward's pending layer, and an event to fire."""

    num_layers: int
    pending: int | None
    shared: dict[str, Any]

    def fire(self, layer: KVLayer, event: Any) -> int: ...

class RuntimeLayer(Protocol):
    """What the runtime may read and call of a layer (``Runtime`` names nothing else of it)."""

    rank: int
    is_initialized: bool
    context_ended: bool
    store: LayerStorage
    counts: LayerCounters
    observed: Observed

    def rows_view(self, ordered: bool = True, end: int | None = None) -> RowsView: ...


# transformers < 5.3 (the kvpress environment's) does not hand a layer's ``update`` the attention call's keyword
# arguments: there the layer whose ``update`` ran last in this context is kept here for kvzoo's attention to find.
ACTIVE_LAYER: contextvars.ContextVar[Any] = contextvars.ContextVar("kvzoo_active_layer", default=None)


class KVLayer(CacheLayerMixin):
    """One layer of a ``TieredCache`` (module docstring). ``keys``, ``values``, ``slots``, ``valid`` and
    ``row_stats`` are snapshots of the attended tier in sequence order (copies, safe to keep)."""

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
        """Empty the layer (its storage, index, counters and event state): ``TieredCache.close()``."""
        runtime = self.runtime
        if getattr(self, "is_initialized", False):
            runtime.held(-self.store.n)
        self.is_initialized = False
        self.refused: str | None = None  # why the cache stopped taking forwards (another model's reached it)
        # the keys update() handed the model (identity-checked by the attention), held weakly: a buffer the layer
        # reallocates (a compression that shrinks it) must not stay alive here
        self.returned: weakref.ref | None = None
        self.counts = LayerCounters()
        self.store = LayerStorage(runtime, self.counts)
        self.context_ended = False  # the context_end event fired (compress(), or the prompt's end in generate)
        self.observed = Observed()  # the window's queries, the recorded inputs, the softmax scale

    def continue_as(self, *, capacity: int | None = None) -> None:
        """This layer -- a copy whose policy changed before any event (``fork_as``, ``transplant``) -- continues under
        its runtime's policy: a new empty index, the new policy's per-row statistics and position lists, and
        (``capacity``) storage preallocated for that many rows."""
        runtime, store = self.runtime, self.store
        store.archive.index = runtime.new_index()
        store.retains = bool(runtime.policy.archive)
        store.budget = None
        if not self.is_initialized:
            return
        rows = store.rows
        stats = {"stat:attention"} if runtime.accumulates else set()
        for name in [n for n in rows.buffers if n.startswith("stat:") and n not in stats]:
            del rows.buffers[name]
        for name in stats - set(rows.buffers):
            rows.add_field(name, (), torch.float32, fill=0.0)
        if capacity is not None:
            rows.fix(max(capacity, rows.n), EMPTY)
        if store.retains:
            store.define_lists(*store.batch_groups, self.device, rows.fixed, refix=capacity is not None)

    # --- transformers' layer contract ----------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor | None) -> None:
        self.store.define(key_states, value_states, self.reserve_rows)
        self.device, self.dtype = key_states.device, key_states.dtype
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
        if key_states.shape[2] == 1 and self.auto_compress and not self.context_ended and self.counts.seen \
                and not runtime.prefilling:  # a one-token chunk of a prompt (TieredCache.prefilling()) ends nothing
            runtime.fire(self, "context_end")  # the prompt ended (generate's first decode step): compress it
        store = self.store
        store.append(key_states, value_states)
        runtime.pending = self.layer_idx
        if isinstance(kwargs.get("kwargs"), dict):  # transformers hands the attention call's kwargs: name the layer
            kwargs["kwargs"]["kvzoo_layer"] = self
        else:  # transformers < 5.3 (kvpress's): the attention finds the layer in this context
            ACTIVE_LAYER.set(self)
        keys = store.rows.buffers["keys"]
        self.returned = weakref.ref(keys)
        return keys, (store.rows.buffers["values"] if value_states is not None else None)

    def _check_rows(self, key_states: torch.Tensor, value_states: torch.Tensor | None) -> None:
        layout = self.runtime.geometry.layout
        known = self.store.rows.buffers.get("keys")
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
        return self.counts.seen + query_length, 0

    def get_seq_length(self) -> int:
        return self.counts.seen

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
        self.store.select_batch(idx)
        self.observed.select_batch(idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if not self.is_initialized:
            return
        self.store.repeat_batch(repeats)
        self.observed.repeat_batch(repeats)

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
        bound = self.owner
        if bound is None:  # a layer made outside a TieredCache: bound to no model
            return
        owner = bound()
        if owner is module:
            return
        whose = (f"not the {type(owner).__name__} of the model of {self.runtime.num_layers} attention layers the cache "
                 "was built for" if owner is not None else "the attention module it was bound to is gone (its model "
                 "was freed): no forward can be its model's")
        message = (
            f"layer {self.layer_idx} of this TieredCache was reached by a forward of another model's attention "
            f"({type(module).__name__} at {id(module):#x}, {whose}): a TieredCache belongs to the model "
            "it was created for; create TieredCache(model, policy) for this model"
        )
        if appended:
            message += (". This cache took that forward's rows before the check and can no longer be used: create a "
                        "new one (close() empties it for reuse)")
            self.refused = message
        raise RuntimeError(message)

    def fire(self, event: str) -> None:
        self.runtime.fire(self, event)

    def rows_view(self, ordered: bool = True, end: int | None = None) -> RowsView:
        """The attended tier as the policy's selector sees it (``ordered=False``: in tier order, for ``step_victim``);
        ``end``: the tier's first ``end`` rows only (in slot order), a block that closes before the rows after it."""
        runtime, store, counts = self.runtime, self.store, self.counts
        if ordered:
            store.ensure_order()
        first_new = max(0, store.n - counts.since_event)  # where the rows since the last event (or the block) start

        def read(name: str) -> torch.Tensor | None:
            if name == "values" and store.latent_width is not None:  # MLA rows: no value of their own
                return None
            return store.get(name) if end is None else store.get(name)[:, :, :end]

        row_stats = store.row_statistics()
        if end is not None:
            row_stats = {name: stat[:, :, :end] for name, stat in row_stats.items()}
        policy, geometry, observed = runtime.policy, runtime.geometry, self.observed
        # the observations, only where there are some (a per-step victim's view: none, and no call)
        window = observed.window(policy.observation_window, counts.seen) if observed.queries is not None else None
        inputs = None
        if observed.inputs:
            inputs = observed.attention_inputs(counts.since_event if end is None else end - first_new)
        return observed_rows(
            policy,
            None, None, None, None,  # read on first use (a per-step victim reads the slots alone)
            read=read,
            window=window,
            layer_idx=self.layer_idx,
            num_layers=runtime.num_layers,
            layout=geometry.layout,
            layer_rank=self.rank,
            branch_dim=geometry.branch_dim,
            first_new=first_new,
            all_valid=store.all_valid,
            row_stats=row_stats,
            shared=runtime.shared,
            info=counts.policy_info,
            inputs=inputs,
        )

    # --- snapshots of the tier, in sequence order ---------------------------------------------------------
    def _ordered(self, name: str) -> torch.Tensor | None:
        """A copy of the tier's rows of ``name`` in sequence order (None before the first row, or no such field)."""
        buffers = self.store.rows.buffers
        if not self.is_initialized or name not in buffers:
            return None
        self.store.ensure_order()
        return self.store.get(name).clone()

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
        self.store.ensure_order()
        return {name: stat.clone() for name, stat in self.store.row_statistics().items()}

    @property
    def retrieval(self):
        """The retriever's index over this layer's archive (None without a retriever)."""
        return self.store.archive.index


__all__ = ["Host", "KVLayer", "RuntimeLayer"]
