"""``TieredCache``: a transformers ``Cache`` that wires a layer store, a model adapter and the runtime.

Per layer and sequence, every row ever appended is in exactly one place (docs/architecture.md): the
**attended tier** -- what every step attends to, whose storage really shrinks at a compression
event -- or the **archive** (evicted rows, bit-exact; or dropped and counted with
``archive=False``). The rows live in a :class:`~kvzoo.framework.store.LayerStore` per layer, a
row's fate is decided by the :class:`~kvzoo.framework.runtime.Runtime`, and the model adapter
attaches kvzoo's attention (``framework/adapters``).

The cache honours transformers' narrow cache contract (``update``, ``get_seq_length``,
``get_mask_sizes``), so ``model.generate(..., cache=cache)`` works unchanged.
``get_seq_length`` reports the *true* sequence length (rows ever seen), so positions and masks
keep counting real tokens after eviction, and decoding continues at the true position.

Nothing points back up: a layer holds its store, its state and the runtime; the runtime holds the
policy and the retriever configuration; no object refers to the cache. A dropped cache is freed at
once, without waiting for the cycle collector.
"""

from __future__ import annotations

import copy
import weakref
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from kvzoo.framework.adapters import adapter_for
from kvzoo.framework.attention import ACTIVE_LAYER, attach
from kvzoo.framework.layer_state import LayerState
from kvzoo.framework.names import policy_retriever, resolve_policy
from kvzoo.framework.policy import Policy
from kvzoo.framework.retrieval import Retrieval
from kvzoo.framework.retriever import RowGeometry
from kvzoo.framework.runtime import Runtime, RuntimeConfig
from kvzoo.framework.store import CacheStats, LayerStats


def _retriever_of(policy: Policy):
    """``policy``'s retriever (or None); a ValueError when it has one but keeps no archive to fetch from."""
    retriever = policy_retriever(policy)
    if retriever is not None and not policy.archive:
        raise ValueError(
            f"policy {policy.name!r} has retriever={retriever.name!r} but archive=False: a retriever "
            "fetches from the archive; use archive=True or retriever=None"
        )
    return retriever


def dense_prefill_problem(policy: Policy) -> str | None:
    """Why ``policy``'s prefill is not a plain dense prefill another policy could share (None: it is): it
    acts during the prefill, accumulates attention or records inputs there, or prefills token by token."""
    if policy.schedule != "context_end":
        return f"{policy.name!r} acts during the prefill (schedule {policy.schedule!r})"
    if policy.observes & {"accumulate", "inputs"}:
        return f"{policy.name!r} observes {sorted(policy.observes & {'accumulate', 'inputs'})} during the prefill"
    if policy.multi_token_window(1 << 30) is not None:
        return f"{policy.name!r} prefills with a window (token by token), not densely"
    return None


class TieredLayer(CacheLayerMixin):
    """One layer's rows (``state.store``) and runtime state, behind transformers' layer contract.

    ``keys``, ``values``, ``slots``, ``valid`` and ``row_stats`` are snapshots of the attended tier
    in sequence order (copies, safe to keep); ``archive`` is the archive's row store.
    """

    is_compileable = False
    is_croppable = False
    is_sliding = False
    # the model's attention module of this layer (a weakref, set by TieredCache): the one forward allowed in
    owner: Any = None
    refused: str | None = None  # why the cache stopped taking forwards (another model's reached it)

    def __init__(self, runtime: Runtime, layer_idx: int, layer_rank: int, *, reserve_rows: int | None = None,
                 decompress_min_queries: int | None = None, auto_compress: bool = True) -> None:
        self.is_initialized = False
        self.runtime = runtime
        self.layer_idx = layer_idx
        self.layer_rank = layer_rank
        self.reserve_rows = reserve_rows
        self.decompress_min_queries = decompress_min_queries  # MLA: the threshold in effect
        self.auto_compress = auto_compress
        self.state: LayerState = runtime.new_layer(layer_idx, layer_rank)
        self.returned_keys: torch.Tensor | None = None  # the view update() handed the model

    # --- snapshots of the live rows, in sequence order ------------------------------------------------
    @property
    def store(self):
        return self.state.store

    def _ordered(self, name: str) -> torch.Tensor | None:
        store = self.state.store
        if not self.is_initialized or name not in store.tier:
            return None
        store.ensure_order()
        return store.get(name).clone()

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
        self.state.store.ensure_order()
        return {name: stat.clone() for name, stat in self.state.store.stats().items()}

    @property
    def archive(self):
        return self.state.store.archive

    @property
    def tier(self):
        return self.state.store.tier

    @property
    def retrieval(self):
        return self.state.index

    @property
    def seen(self) -> int:
        return self.state.store.seen

    @property
    def num_rows(self) -> int:
        return self.state.store.n

    # --- which model may use this layer ------------------------------------------------------
    def check_owner(self, module: torch.nn.Module, *, appended: bool) -> None:
        """Refuse (RuntimeError) a forward of ``module`` unless it is the attention module of this layer in the
        model the cache was built for: another model, even one with a TieredCache of its own (so running kvzoo's
        attention), and even one of the same architecture, would attend over rows it never wrote.
        ``appended``: the forward's rows already went into this layer (GQA's ``update`` runs before the
        attention); the cache then refuses every later forward until :meth:`reset` (``close()``)."""
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

    # --- transformers' layer contract --------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor | None) -> None:
        geometry = self.runtime.geometry
        latent = geometry.content_dim if geometry.layout == "mla" else None
        self.state.store.define(key_states, value_states, self.runtime.policy.new_row_stats(),
                                reserve=self.reserve_rows or 0, latent_width=latent, capacity=self.runtime.capacity)
        self.device, self.dtype = key_states.device, key_states.dtype
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor | None, *args: Any, **kwargs: Any):
        """Append this forward's rows (``[B, G, q, D]``) to the attended tier; return the tier.

        ``value_states`` is None for MLA layers, whose latent row serves as key and value.
        """
        if self.refused is not None:
            raise RuntimeError(self.refused)
        layout = self.runtime.geometry.layout
        if (value_states is None) != (layout == "mla") or (
                self.returned_keys is not None and (key_states.shape[1], key_states.shape[-1])
                != (self.returned_keys.shape[1], self.returned_keys.shape[-1])):
            got = "latent rows (MLA)" if value_states is None else f"keys and values of {key_states.shape[1]} KV heads"
            raise RuntimeError(
                f"layer {self.layer_idx} of this TieredCache was built for {'an MLA' if layout == 'mla' else 'a GQA'} "
                f"model and received "
                f"{got} of width {key_states.shape[-1]}: a TieredCache belongs to the model it was created for; "
                "create TieredCache(model, policy) for this model"
            )
        pending = ACTIVE_LAYER.get()
        if pending is not None and pending.runtime is self.runtime:
            raise RuntimeError(
                f"layer {pending.layer_idx} of this TieredCache received rows but its attention never ran through "
                "kvzoo: the model using the cache does not run kvzoo's attention. A TieredCache belongs to the model "
                "it was created for (it attaches kvzoo's attention to that model): create TieredCache(model, policy) "
                "for this model. (If the previous forward failed midway, create a new cache.)"
            )
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        store = self.state.store
        if key_states.shape[2] == 1 and self.auto_compress and not self.state.context_ended and store.seen:
            # the prompt ended (generate's first decode step): compress it, as the pipeline's compress() does
            self.runtime.fire(self.state, "context_end")
        store.append(key_states, value_states)
        ACTIVE_LAYER.set(self)
        # what the attention reads: a decode step the tier as the step reads it (framework/step.py), a forward of
        # several queries the live rows
        read = store.reading if key_states.shape[2] == 1 else store.get
        self.returned_keys = read("keys")
        return self.returned_keys, (read("values") if value_states is not None else None)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # Masks are sized by true sequence length; the attention function maps rows to columns by slot.
        return self.state.store.seen + query_length, 0

    def get_seq_length(self) -> int:
        return self.state.store.seen

    def get_max_length(self) -> int:
        return -1

    def get_max_cache_shape(self) -> int:  # the layer contract of transformers < 5.3 (kvpress's): unbounded
        return -1

    def reset(self) -> None:
        self.is_initialized = False
        self.refused = None
        self.state = self.runtime.new_layer(self.layer_idx, self.layer_rank)
        self.returned_keys = None

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.batch_select_indices(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep batch elements ``indices`` (beam reordering): rows, archive and the retrieval index move together."""
        if not self.is_initialized:
            return
        idx = indices.to(self.device)
        state = self.state
        state.store.select_batch(idx)
        if state.window_queries is not None:
            state.window_queries = state.window_queries.index_select(0, idx)
        if state.index is not None:
            state.index.select_batch(idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if not self.is_initialized:
            return
        state = self.state
        state.store.repeat_batch(repeats)
        if state.window_queries is not None:
            state.window_queries = state.window_queries.repeat_interleave(repeats, dim=0)
        if state.index is not None:
            state.index.repeat_batch(repeats)

    def crop(self, tokens_to_remove: int) -> None:
        raise RuntimeError(
            "TieredCache cannot be cropped (assisted/speculative decoding rolls back rows that may already "
            "be archived); use greedy or sampling generation"
        )

    def fire(self, event: str) -> None:
        self.runtime.fire(self.state, event)

    def stats(self) -> LayerStats:
        return self.runtime.layer_stats(self.state)


class TieredCache(Cache):
    """A two-tier KV cache driven by a kvzoo policy. Drop-in for ``model.generate``.

    >>> cache = TieredCache(model, registry.get("streaming_llm", ratio=4))
    >>> out = model.generate(**inputs, cache=cache, max_new_tokens=32)

    Creating the cache attaches kvzoo's attention to ``model`` (``kvzoo.framework.attention.attach``);
    with any other cache that attention behaves exactly like SDPA. Policies with a ``step`` or
    ``block`` schedule compress by themselves during ``generate``; a ``context_end`` compression
    happens when you call :meth:`compress` (``kvzoo.pipeline`` does it after the context).

    ``policy``: a Policy, a registered name or spec (``"quest(gqa=group)"``), or None (``full``).
    ``context_length``: the prompt's length when known, so a ratio budget counts the whole context
    even when a chunked prefill fires the first event early. ``audit=True``: every retrieval also
    scores all archived rows exactly (bound violations, recall; slow). ``decompress_min_queries``:
    MLA forwards with at least this many queries attend in decompressed per-head form (None: the
    FLOP break-even of the model's geometry; a decode step is always absorbed).

    ``auto_compress`` (default True): a layer whose context was not compressed yet (no
    :meth:`compress`) compresses at the first single-token forward -- the end of the prompt's
    prefill inside ``model.generate`` -- so policies that compress at the context's end (SnapKV,
    ChunkKV, VestigeKV's open block) do so there too.

    ``capacity=N`` (the most tokens the sequence will hold, prompt and generated): each layer's attended tier,
    archive and index are preallocated for ``N`` rows, and a decode step reads the whole buffers with the live
    counts, positions and validity on the device, so consecutive steps between events launch the same ops on the
    same shapes and storage (what a CUDA graph replays; ``tests/test_static_step.py`` records it). After each
    event the tier's storage is resized to the most rows it can reach before the next one. A sequence longer
    than ``N`` still works (the storage grows: an event). The price: on the PyTorch path a step reads the spare
    rows too (masked), as transformers' ``StaticCache`` does; the Triton kernel skips them.

    ``cuda_graph=True`` (needs ``capacity`` and CUDA): decode steps are captured once in a CUDA graph after each
    event and replayed (``framework/graphs.py``). Off by default: it has not run on a GPU yet.

    Use it as a context manager, or call :meth:`close`, to free its rows at a known point.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        policy: Policy | str | None = None,
        *,
        context_length: int | None = None,
        audit: bool = False,
        decompress_min_queries: int | None = None,
        auto_compress: bool = True,
        record_window: int = 0,
        capacity: int | None = None,
        cuda_graph: bool = False,
    ) -> None:
        policy = resolve_policy(policy)
        if isinstance(record_window, bool) or not isinstance(record_window, int) or record_window < 0:
            raise ValueError(f"record_window must be an int >= 0 (queries kept for fork_as), got {record_window!r}")
        if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1):
            raise ValueError(f"capacity must be None (buffers grow as rows arrive) or an int >= 1 (the most tokens "
                             f"the sequence will hold, prompt and generated), got {capacity!r}")
        if not isinstance(cuda_graph, bool):
            raise ValueError(f"cuda_graph must be True or False, got {cuda_graph!r}")
        if cuda_graph:
            from kvzoo.framework.graphs import check_cuda_graph

            check_cuda_graph(model, capacity)
        retriever = _retriever_of(policy)
        if decompress_min_queries is not None and (
            isinstance(decompress_min_queries, bool) or not isinstance(decompress_min_queries, int)
            or decompress_min_queries < 2
        ):
            raise ValueError(
                "decompress_min_queries must be None (the model's FLOP break-even) or an int >= 2 (a decode step "
                f"of one query always attends in absorbed form), got {decompress_min_queries!r}"
            )
        adapter = adapter_for(model, policy)
        adapter.attach()
        attach(model)
        shape = adapter.geometry
        tiered = list(shape.tiered)
        geometry = RowGeometry(shape.layout, shape.content_dim, shape.branch_dim, capacity=capacity)
        retrieval = Retrieval(retriever, audit=audit) if retriever is not None else None
        self.runtime = Runtime(RuntimeConfig(policy, retrieval, geometry, len(tiered), record_window),
                               context_length=context_length)
        self.adapter = adapter
        # a policy that never evicts (full) holds the whole context: reserve it once instead of growing
        reserve = context_length if context_length and not policy.requires_budget else None
        threshold = decompress_min_queries or shape.decompress_min_queries
        layers = [
            TieredLayer(self.runtime, i, tiered.index(i), reserve_rows=reserve, decompress_min_queries=threshold,
                        auto_compress=auto_compress)
            if i in tiered else adapter.untiered_layer(i)  # the layers kvzoo leaves alone (Kimi's KDA layers)
            for i in range(shape.num_layers)
        ]
        modules = adapter.attention_modules()
        for i in tiered:  # bound to this model's attention modules: another model's forward is refused
            if i in modules:
                layers[i].owner = weakref.ref(modules[i])
        super().__init__(layers=layers)
        self.graph = None
        if cuda_graph:
            from kvzoo.framework.graphs import install

            self.graph = install(model, self)

    # --- what the runtime holds, by its user-facing names ------------------------------------------
    @property
    def policy(self) -> Policy:
        return self.runtime.policy

    @property
    def retriever(self):
        return self.runtime.retriever

    @property
    def audit(self) -> bool:
        return self.runtime.audit

    @property
    def context_length(self) -> int | None:
        return self.runtime.context_length

    @context_length.setter
    def context_length(self, value: int | None) -> None:
        self.runtime.context_length = value

    @property
    def tiered_layers(self) -> list[TieredLayer]:
        """The layers kvzoo compresses, in order (all layers on GQA; the MLA layers on Kimi Linear)."""
        return [layer for layer in self.layers if isinstance(layer, TieredLayer)]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor | None, layer_idx: int, *args: Any,
               **kwargs: Any):
        if not 0 <= layer_idx < len(self.layers):
            raise IndexError(
                f"layer {layer_idx} does not exist in this TieredCache, which was built for a model of "
                f"{len(self.layers)} layers; a cache belongs to the model it was created for: create "
                "TieredCache(model, policy) for this model"
            )
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def kvzoo_layer(self, layer_idx: int) -> TieredLayer | None:
        """The tiered layer ``layer_idx`` (how an MLA adapter's forward finds the store for its rows)."""
        layer = self.layers[layer_idx] if layer_idx < len(self.layers) else None
        return layer if isinstance(layer, TieredLayer) else None

    def compress(self) -> None:
        """The context ended: fire the ``context_end`` event on every layer."""
        for layer in self.tiered_layers:
            layer.fire("context_end")

    def stats(self) -> CacheStats:
        return CacheStats(policy=self.policy.config(), layers=[layer.stats() for layer in self.tiered_layers],
                          notes=self.runtime.notes([layer.state for layer in self.tiered_layers]))

    def fork(self) -> TieredCache:
        """An independent copy of this cache's rows, archive, indexes and counters (the model shared).

        What a benchmark needs to prefill and compress once and then continue several ways (answer,
        continuation, question): the copy's tensors are new; its adapter and :class:`RuntimeConfig` (policy,
        retrieval tier, geometry) are this cache's, its per-cache state copied (:meth:`_clone`). A fork decodes eagerly (a CUDA graph belongs to
        its cache's buffers).
        """
        shared, states = self._copied((self.runtime.shared, self._layer_states()))  # one pass: shared storage stays so
        return self._clone(Runtime(self.runtime.config, self.runtime.context_length, shared), states)

    def _layer_states(self) -> list[Any]:
        """What each layer holds of the sequence: a tiered layer's :class:`LayerState` (rows, archive, index,
        counters, kept queries) and the view it last handed the model; a layer kvzoo does not tier (Kimi's KDA
        layers) whole."""
        return [(layer.state, layer.returned_keys) if isinstance(layer, TieredLayer) else layer for layer in self.layers]

    def _clone(self, runtime: Runtime, states: list[Any]) -> TieredCache:
        """A cache on the same model and adapter that runs with ``runtime`` and holds ``states`` (copies of
        :meth:`_layer_states`); the rest of each layer (its index and rank, the module it belongs to, its settings)
        is taken as it is."""
        clone = copy.copy(self)  # the Cache's own settings, the adapter: shared
        clone.runtime, clone.graph = runtime, None
        clone.layers = []
        for layer, state in zip(self.layers, states):
            if isinstance(layer, TieredLayer):
                twin = copy.copy(layer)
                twin.runtime, (twin.state, twin.returned_keys) = runtime, state
                state = twin
            clone.layers.append(state)
        return clone

    def _copied(self, state: Any) -> Any:
        """A deep copy of ``state`` (tensors, counters), sharing the configuration objects it may point to (the
        policy, the retrieval tier and its retriever: a retriever's index state may keep its retriever)."""
        shared = (self.runtime.policy, self.runtime.retrieval, self.runtime.retriever)
        try:
            return copy.deepcopy(state, {id(obj): obj for obj in shared if obj is not None})
        except RuntimeError as err:
            if "graph leaves" not in str(err):
                raise
            raise RuntimeError(
                "TieredCache.fork(): this cache holds tensors of an autograd graph -- it was filled with gradients "
                "enabled (model(ids, cache=cache) outside torch.no_grad()) -- and such tensors cannot be copied. A "
                "cache needs no graph: fill it under torch.no_grad() (or torch.inference_mode()), then fork it"
            ) from None

    def prefill_shared_with(self, policy: Policy | str) -> str | None:
        """Why a fork of this cache cannot continue as ``policy`` (:meth:`fork_as`); None when it can.

        It can when nothing so far depended on the policy: no event has fired (nothing compressed, nothing
        archived), both policies prefill densely and act only at the context's end, neither accumulates
        attention during the prefill nor records the attention modules' inputs, and the queries kept cover
        ``policy``'s observation window.
        """
        policy = resolve_policy(policy)
        states = [layer.state for layer in self.tiered_layers]
        if any(s.context_ended or s.budget is not None or s.store.archive.n for s in states):
            return "this cache has compressed already (an event fired)"
        for role, p in (("this cache's policy", self.policy), ("the new policy", policy)):
            problem = dense_prefill_problem(p)
            if problem is not None:
                return f"{role} {problem}"
        layout = self.adapter.geometry.layout
        if layout not in policy.layouts:
            return f"policy {policy.name!r} supports layouts {policy.layouts}, this model is {layout!r}"
        needed = policy.observation_window if "window" in policy.observes else 0
        if needed > self.runtime.observation_window:
            return (f"policy {policy.name!r} reads the last {needed} queries, this cache kept "
                    f"{self.runtime.observation_window} (create it with record_window={needed})")
        return None

    def fork_as(self, policy: Policy | str) -> TieredCache:
        """A new cache that continues this prefilled, not yet compressed one as ``policy``: a constructor.

        One dense prefill then serves several policies that would have computed the very same prefill
        (a benchmark's grid): the new cache's rows, counters and kept queries are this cache's, bit for bit
        (its queries cut to ``policy``'s window); it runs with a runtime of its own -- ``policy``, its
        retriever with an empty index, its budget still to be fixed -- on this cache's model, adapter and
        geometry. A ValueError says why when the prefill is not ``policy``'s to share
        (:meth:`prefill_shared_with`).
        """
        policy = resolve_policy(policy)
        problem = self.prefill_shared_with(policy)
        if problem is not None:
            raise ValueError(f"fork_as({policy.name!r}): {problem}")
        retriever = _retriever_of(policy)
        old = self.runtime
        retrieval = Retrieval(retriever, audit=old.audit) if retriever is not None else None
        runtime = Runtime(RuntimeConfig(policy, retrieval, old.geometry, old.num_layers),
                          context_length=old.context_length)
        clone = self._clone(runtime, self._copied(self._layer_states()))
        window = runtime.observation_window
        for layer in clone.tiered_layers:
            layer.state.index = retrieval.new_state(runtime.geometry) if retrieval is not None else None
            queries = layer.state.window_queries
            if queries is not None:
                layer.state.window_queries = queries[:, :, -window:].clone() if window > 0 else None
        return clone

    def close(self) -> None:
        """Free every layer's rows now (the cache is empty and reusable afterwards)."""
        for layer in self.tiered_layers:
            layer.reset()

    def __enter__(self) -> TieredCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"TieredCache(policy={self.policy!r}, layers={len(self.layers)})"


__all__ = ["TieredCache", "TieredLayer", "CacheStats", "LayerStats", "dense_prefill_problem"]
