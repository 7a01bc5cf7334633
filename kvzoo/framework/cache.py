"""``TieredCache``: a transformers ``Cache`` that wires the layers, a model adapter and the runtime.

Each layer is one :class:`~kvzoo.framework.layer.KVLayer` (its rows, views, index and counters), a row's fate is
decided by the :class:`~kvzoo.framework.runtime.Runtime`, and the model adapter attaches kvzoo's attention. The
cache honours transformers' cache contract, so ``model.generate(..., cache=cache)`` works unchanged;
``get_seq_length`` reports the *true* sequence length, so positions keep counting real tokens after eviction.
Nothing points back up: no object refers to the cache.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from transformers.cache_utils import Cache

from kvzoo.framework.adapters import ADAPTER, adapter_for
from kvzoo.framework.attention import after_forward, attach
from kvzoo.framework.forks import (
    clone,
    compressed,
    continue_as,
    dense_prefill_problem,
    prefill_problem,
    retriever_of,
)
from kvzoo.framework.layer import KVLayer
from kvzoo.framework.names import resolve_policy
from kvzoo.framework.plugins import plugin_failed, plugin_label
from kvzoo.framework.policy import Policy
from kvzoo.framework.report import cache_stats
from kvzoo.framework.retrieval import Retrieval
from kvzoo.framework.retriever import RowGeometry
from kvzoo.framework.runtime import Runtime, RuntimeConfig
from kvzoo.framework.stats import CacheStats, LayerStats


def _check_settings(model: torch.nn.Module, record_window: Any, record_attention: Any, capacity: Any, cuda_graph: Any,
                    decompress_min_queries: Any) -> None:
    """``TieredCache``'s settings, checked before anything is attached (a ValueError says what is valid)."""
    if isinstance(record_window, bool) or not isinstance(record_window, int) or record_window < 0:
        raise ValueError(f"record_window must be an int >= 0 (queries kept for fork_as), got {record_window!r}")
    if not isinstance(record_attention, bool):
        raise ValueError(f"record_attention must be True or False, got {record_attention!r}")
    if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1):
        raise ValueError(f"capacity must be None (buffers grow as rows arrive) or an int >= 1 (the most tokens "
                         f"the sequence will hold, prompt and generated), got {capacity!r}")
    limit = getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)
    if capacity is not None and isinstance(limit, int) and capacity > limit:
        raise ValueError(f"capacity={capacity} is more tokens than {type(model).__name__} has positions for "
                         f"(max_position_embeddings={limit}): use capacity <= {limit}")
    if not isinstance(cuda_graph, bool):
        raise ValueError(f"cuda_graph must be True or False, got {cuda_graph!r}")
    if cuda_graph:
        from kvzoo.framework.graphs import check_cuda_graph

        check_cuda_graph(model, capacity)
    if decompress_min_queries is not None and (
        isinstance(decompress_min_queries, bool) or not isinstance(decompress_min_queries, int)
        or decompress_min_queries < 2
    ):
        raise ValueError(
            "decompress_min_queries must be None (the model's FLOP break-even) or an int >= 2 (a decode step "
            f"of one query always attends in absorbed form), got {decompress_min_queries!r}"
        )


def _bind(model: torch.nn.Module, adapter: Any, layers: list, tiered: list[int]) -> None:
    """Bind each tiered layer to its attention module in ``model``, so that another model's forward is refused: the
    adapter must name modules of ``model`` itself (a module of no model dies at once, and the guard with it)."""
    try:
        modules = adapter.attention_modules()
    except Exception as err:
        plugin_failed(adapter, ADAPTER, "attention_modules", err)
    missing = [i for i in tiered if not isinstance(modules.get(i) if isinstance(modules, dict) else None,
                                                    torch.nn.Module)]
    contract = ("attention_modules() must map every layer kvzoo compresses to that layer's attention module in the "
                "model (a TieredCache is bound to them, so that another model's forward is refused)")
    if missing:
        raise ValueError(
            f"{plugin_label(adapter, ADAPTER)}: {contract}; layers {missing} have none (got {type(modules).__name__} "
            f"with keys {sorted(modules) if isinstance(modules, dict) else []})"
        )
    own = {id(module) for module in model.modules()}
    strangers = [i for i in tiered if id(modules[i]) not in own]
    if strangers:
        raise ValueError(
            f"{plugin_label(adapter, ADAPTER)}: attention_modules() returned modules that are not "
            f"{type(model).__name__}'s for layers {strangers} ({type(modules[strangers[0]]).__name__} at "
            f"{id(modules[strangers[0]]):#x} for layer {strangers[0]}): {contract}"
        )
    for i in tiered:  # bound to this model's attention modules: another model's forward is refused
        layers[i].owner = weakref.ref(modules[i])


def _untiered_layer(adapter: Any, layer_idx: int) -> Any:
    """The adapter's own cache layer for ``layer_idx`` (one kvzoo does not compress), its fault naming it."""
    try:
        return adapter.untiered_layer(layer_idx)
    except Exception as err:
        plugin_failed(adapter, ADAPTER, "untiered_layer", err)


class TieredCache(Cache):
    """A two-tier KV cache driven by a kvzoo policy. Drop-in for ``model.generate``.

    >>> cache = TieredCache(model, registry.get("streaming_llm", ratio=4))
    >>> out = model.generate(**inputs, cache=cache, max_new_tokens=32)

    Creating the cache attaches kvzoo's attention to ``model`` (with any other cache it behaves exactly like SDPA).
    ``step`` and ``block`` policies compress by themselves; a ``context_end`` compression happens at :meth:`compress`
    (``kvzoo.pipeline`` calls it after the context) or, with ``auto_compress`` (default), at the first single-token
    forward -- the prompt's end inside ``model.generate``. A prompt fed in chunks of one token runs inside
    :meth:`prefilling` (``kvzoo.pipeline.prefill`` does), so that its first chunk does not end it.

    ``policy``: a Policy, a registered name or spec (``"quest(gqa=group)"``), or None (``full``). ``context_length``:
    the prompt's length when known, so a ratio budget counts the whole context even when a chunked prefill fires the
    first event early. ``audit=True``: every retrieval also scores all archived rows exactly (bound violations,
    recall; slow). ``decompress_min_queries``: MLA forwards with at least this many queries attend in decompressed
    per-head form (None: the FLOP break-even of the model's geometry; a decode step is always absorbed).

    ``capacity=N`` (the most tokens the sequence will hold): each layer's storage is preallocated for ``N`` rows and
    a decode step reads whole buffers with the live counts on the device, so steps between events launch the same
    ops on the same shapes and storage (what a CUDA graph replays); after each event the tier's storage is sized to
    the most rows it can reach before the next. A longer sequence still works (the storage grows: an event). The
    price: the PyTorch path reads the spare rows too (masked), as ``StaticCache`` does; the Triton kernel skips them.
    ``cuda_graph=True`` (needs ``capacity`` and CUDA): decode steps are captured after each event and replayed
    (``framework/graphs.py``; off by default: it has not run on a GPU yet).

    ``record_window=w`` and ``record_attention=True`` make a prefill that other policies continue (:meth:`fork_as`):
    it keeps each layer's last ``w`` queries and accumulates each row's received attention (through the reference
    attention, as H2O's own prefill does).

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
        record_attention: bool = False,
        capacity: int | None = None,
        cuda_graph: bool = False,
    ) -> None:
        policy = resolve_policy(policy)
        _check_settings(model, record_window, record_attention, capacity, cuda_graph, decompress_min_queries)
        retriever = retriever_of(policy)
        adapter = adapter_for(model, policy)
        try:
            adapter.attach()
        except Exception as err:
            plugin_failed(adapter, ADAPTER, "attach", err)
        attach(model)
        shape = adapter.geometry
        tiered = list(shape.tiered)
        geometry = RowGeometry(shape.layout, shape.content_dim, shape.branch_dim, capacity=capacity)
        retrieval = Retrieval(retriever, audit=audit) if retriever is not None else None
        self.runtime = Runtime(RuntimeConfig(policy, retrieval, geometry, len(tiered), record_window, record_attention),
                               context_length=context_length)
        self.adapter = adapter
        # a policy that never evicts (full) holds the whole context: reserve it once instead of growing
        reserve = context_length if context_length and not policy.requires_budget else None
        threshold = decompress_min_queries or shape.decompress_min_queries
        layers = [
            KVLayer(self.runtime, i, tiered.index(i), reserve_rows=reserve, decompress_min_queries=threshold,
                    auto_compress=auto_compress)
            if i in tiered else _untiered_layer(adapter, i)  # the layers kvzoo leaves alone (Kimi's KDA layers)
            for i in range(shape.num_layers)
        ]
        _bind(model, adapter, layers, tiered)
        super().__init__(layers=layers)
        self.untiered_read: dict[int, int] = {}  # layer -> bytes the forwards' attention read from it
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
    def tiered_layers(self) -> list[KVLayer]:
        """The layers kvzoo compresses, in order (all layers on GQA; the MLA layers on Kimi Linear)."""
        return [layer for layer in self.layers if isinstance(layer, KVLayer)]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor | None, layer_idx: int, *args: Any,
               **kwargs: Any):
        if not 0 <= layer_idx < len(self.layers):
            raise IndexError(
                f"layer {layer_idx} does not exist in this TieredCache, which was built for a model of "
                f"{len(self.layers)} layers; a cache belongs to the model it was created for: create "
                "TieredCache(model, policy) for this model"
            )
        layer = self.layers[layer_idx]
        if not isinstance(layer, KVLayer) and not callable(getattr(layer, "update", None)):
            raise RuntimeError(
                f"layer {layer_idx} of this TieredCache is a {type(layer).__name__} (a layer the model it was built "
                f"for keeps to itself, e.g. Kimi Linear's linear attention) and received keys and values: another "
                "model's forward reached the cache. A TieredCache belongs to the model it was created for: create "
                "TieredCache(model, policy) for this model"
            )
        out = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        if not isinstance(layer, KVLayer):  # a sliding-window layer: its attention reads what update returned
            self.untiered_read[layer_idx] = self.untiered_read.get(layer_idx, 0) + sum(
                t.numel() * t.element_size() for t in out if isinstance(t, torch.Tensor))
        return out

    def kvzoo_layer(self, layer_idx: int) -> KVLayer | None:
        """The tiered layer ``layer_idx`` (how an MLA adapter's forward finds the layer for its rows)."""
        layer = self.layers[layer_idx] if layer_idx < len(self.layers) else None
        return layer if isinstance(layer, KVLayer) else None

    def _settle(self) -> None:
        """Bring the layers' host counters up to date after CUDA-graph replays (``framework/graphs.py``)."""
        if self.graph is not None:
            self.graph.settle()

    def get_seq_length(self, layer_idx: int = 0) -> int:
        seen = super().get_seq_length(layer_idx)
        return seen + (self.graph.pending if self.graph is not None else 0)  # replays not yet settled: one each

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._settle()
        super().reorder_cache(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._settle()
        super().batch_select_indices(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._settle()
        super().batch_repeat_interleave(repeats)

    @contextlib.contextmanager
    def prefilling(self) -> Iterator[TieredCache]:
        """The forwards inside this block feed a prompt, in chunks of any size: a one-token chunk is part of it, not
        ``generate``'s first decode step, so ``auto_compress`` does not end the context there (which would compress
        the prompt's first rows and make a policy observe the wrong queries). End the context with
        :meth:`context_end` before the prompt's last forward, or :meth:`compress` after it; ``kvzoo.pipeline.prefill``
        does both."""
        runtime = self.runtime
        held, runtime.prefilling = runtime.prefilling, True
        try:
            yield self
        finally:
            runtime.prefilling = held

    def context_end(self) -> None:
        """The next forward ends the context: each layer compresses right after its own attention in it (as kvpress's
        forward hook does), so one layer at a time holds its whole prefill; the rows kept are those :meth:`compress`
        would keep. Call it before the context's last forward (``kvzoo.pipeline`` does), or before ``generate``."""
        self._settle()
        self.runtime.ending = True

    def compress(self) -> None:
        """The context ended: every layer's ``context_end`` event (a no-op after :meth:`context_end`'s forward)."""
        self._settle()
        for layer in self.tiered_layers:
            layer.fire("context_end")

    def stats(self) -> CacheStats:
        self._settle()
        return cache_stats(self)

    def fork(self) -> TieredCache:
        """An independent copy of this cache's rows, archive, indexes and counters, to prefill and compress once and
        continue several ways: its tensors are new; its model, adapter and :class:`RuntimeConfig` are this cache's.
        A fork decodes eagerly (a CUDA graph belongs to its cache's buffers)."""
        self._settle()
        return clone(self, Runtime(self.runtime.config, self.runtime.context_length), shared=True)

    def prefill_shared_with(self, policy: Policy | str, *, ends_context: bool = False,
                            one_forward: bool = False) -> str | None:
        """Why a fork of this cache cannot continue as ``policy`` (:meth:`fork_as`); None when it can
        (:func:`~kvzoo.framework.forks.prefill_problem` states the rules)."""
        return prefill_problem(self, resolve_policy(policy), ends_context=ends_context, one_forward=one_forward)

    def fork_as(self, policy: Policy | str, *, ends_context: bool = False, one_forward: bool = False) -> TieredCache:
        """A new cache that continues this prefilled, not yet compressed one as ``policy`` (one dense prefill serves
        a benchmark's grid): its rows, counters and kept queries are this cache's, bit for bit, with a runtime of its
        own. A ValueError says why when the prefill is not ``policy``'s to share (:meth:`prefill_shared_with`).

        ``ends_context=True``: ``policy``'s own prefill would have been one forward that ends the context, so the
        fork fires each layer's scheduled event, then ``context_end``. ``one_forward=True``: the prefill so far was
        the first forward of ``policy``'s own (VestigeKV's first block): the fork fires its scheduled event.
        """
        policy = resolve_policy(policy)
        problem = self.prefill_shared_with(policy, ends_context=ends_context, one_forward=one_forward)
        if problem is not None:
            raise ValueError(f"fork_as({policy.name!r}): {problem}")
        self._settle()
        clone = continue_as(self, policy)
        if ends_context or one_forward:
            runtime = clone.runtime
            runtime.ending = ends_context
            for layer in clone.tiered_layers:  # what each layer's attention would have fired, in the forward's order
                after_forward(layer)
            runtime.ending = False
        return clone

    def transplant(self, policy: Policy | str, *, capacity: int | None = None, context_length: int | None = None,
                   cuda_graph: bool = False, model: torch.nn.Module | None = None) -> TieredCache:
        """A new cache of ``policy`` holding this cache's rows as they are, whatever policy prefilled them (its index
        empty, its budget to be fixed): a benchmark's way to hand every arm the same rows. ``capacity`` and
        ``cuda_graph`` (with the ``model`` the cache belongs to) as ``TieredCache``'s. Refused once this cache has
        compressed (its rows are no longer the prefill's)."""
        policy = resolve_policy(policy)
        if cuda_graph:
            from kvzoo.framework.graphs import check_cuda_graph

            if model is None:
                raise ValueError("transplant(cuda_graph=True) needs model=, the model the cache belongs to (its forward "
                                 "is routed through the graph)")
            check_cuda_graph(model, capacity)
        if compressed(self):
            raise ValueError("transplant(): this cache has compressed already (an event fired)")
        layout = self.adapter.geometry.layout
        if layout not in policy.layouts:
            raise ValueError(f"transplant(): policy {policy.name!r} supports layouts {policy.layouts}, this model is "
                             f"{layout!r}")
        self._settle()
        clone = continue_as(self, policy, capacity=capacity, context_length=context_length)
        if cuda_graph:
            from kvzoo.framework.graphs import install

            clone.graph = install(model, clone)
        return clone

    def close(self) -> None:
        """Free every layer's rows now (the cache is empty and reusable afterwards)."""
        if self.graph is not None:
            self.graph.pending, self.graph.captured, self.graph.warm = 0, None, None
        for layer in self.tiered_layers:
            layer.reset()

    def __enter__(self) -> TieredCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"TieredCache(policy={self.policy!r}, layers={len(self.layers)})"


__all__ = ["TieredCache", "KVLayer", "CacheStats", "LayerStats", "dense_prefill_problem"]
