"""The runtime: the one place a row's fate is decided.

A :class:`Runtime` (one per cache) holds the policy, the retrieval tier (:class:`~kvzoo.framework.retrieval.
Retrieval`, or None) and what the model's geometry says; each layer keeps a :class:`LayerState` beside its
store. After a forward's attention the runtime fires the policy's schedule for the layer
(:meth:`Runtime.after_forward`): it resolves the layer's budget once (from the whole context when the cache
knows its length), asks the policy how many rows stay, calls the selector, moves the rows it does not keep to
the archive (indexing them for the retriever) or drops them, and counts. A per-step "one in, one out" moves
``O(1)`` rows in place (:meth:`~kvzoo.framework.policy.Policy.step_victim`). With a fixed capacity
(``TieredCache(..., capacity=N)``) it also sizes the tier's storage after each event to the most rows the
tier can reach before the next one, so a decode step reads no more than it may need.

How a decode step reads the rows is ``framework/step.py``; a multi-token forward, ``framework/attention.py``.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from kvzoo.framework.layer_state import LayerState
from kvzoo.framework.policy import (
    AttentionInputs,
    Event,
    Observation,
    Policy,
    RowsView,
    WindowQueries,
    observed_rows,
)
from kvzoo.framework.retrieval import Retrieval, figures
from kvzoo.framework.retriever import RowGeometry
from kvzoo.framework.store import LayerStats, LayerStore


def _number(value: Any) -> float:
    """A counter as a Python number (device tensors are read here, outside the decode step)."""
    if isinstance(value, torch.Tensor):
        value = value.item()
    return int(value) if float(value).is_integer() else float(value)


@dataclass(frozen=True)
class RuntimeConfig:
    """What a cache runs with, fixed when it is made (a fork shares it; ``fork_as`` makes another).

    ``geometry`` describes the rows (layout, latent and branch widths, the fixed capacity if any);
    ``num_layers`` counts the layers kvzoo compresses; ``record_window``: queries kept beyond the policy's own
    window, for a prefill that policies with wider windows continue from (``TieredCache(..., record_window=w)``
    and ``fork_as``; the policy itself sees only its own window's).
    """

    policy: Policy
    retrieval: Retrieval | None
    geometry: RowGeometry
    num_layers: int
    record_window: int = 0


@dataclass
class Runtime:
    """A cache's :class:`RuntimeConfig` and its per-cache state: the context's length (when the pipeline knows it, a
    ratio budget counts the whole context) and the policy's cross-layer scratch (``shared``: ChunkKV's reuse).
    The configuration's fields read as the runtime's own (``runtime.policy``)."""

    config: RuntimeConfig
    context_length: int | None = None
    shared: dict[str, Any] = field(default_factory=dict)

    policy = property(lambda self: self.config.policy)
    retrieval = property(lambda self: self.config.retrieval)
    geometry = property(lambda self: self.config.geometry)
    num_layers = property(lambda self: self.config.num_layers)
    record_window = property(lambda self: self.config.record_window)

    @property
    def retriever(self):
        return self.retrieval.retriever if self.retrieval is not None else None

    @property
    def audit(self) -> bool:
        return self.retrieval is not None and self.retrieval.audit

    @property
    def capacity(self) -> int | None:
        return self.geometry.capacity

    @property
    def accumulates(self) -> bool:
        """The policy observes each row's accumulated attention: the attention path adds to ``stat:attention``."""
        return Observation.ACCUMULATE in self.policy.observes

    @property
    def observation_window(self) -> int:
        """How many of the latest queries each layer keeps: the policy's window, or ``record_window`` if wider."""
        return max(self.policy.observation_window, self.record_window)

    def new_layer(self, layer_idx: int, layer_rank: int) -> LayerState:
        index = self.retrieval.new_state(self.geometry) if self.retrieval is not None else None
        return LayerState(layer_idx, layer_rank, index=index)

    # --- the rows the selector sees ---------------------------------------------------------------
    def view(self, state: LayerState, ordered: bool = True) -> RowsView:
        """The attended tier as a :class:`RowsView` (``ordered=False``: as stored, for ``step_victim``)."""
        store = state.store
        if ordered:
            store.ensure_order()
        window = None
        if state.window_queries is not None:
            queries = state.window_queries[:, :, -self.policy.observation_window:]
            window = WindowQueries(queries.shape[2], store.seen, state.scaling, lambda: queries)
        return observed_rows(
            self.policy,
            store.get("keys"),
            store.get("values") if "values" in store.tier else None,
            store.get("slots"),
            store.get("valid"),
            window=window,
            layer_idx=state.layer_idx,
            num_layers=self.num_layers,
            layout=self.geometry.layout,
            layer_rank=state.layer_rank,
            branch_dim=self.geometry.branch_dim,
            first_new=max(0, store.n - store.since_event),
            row_stats=store.stats(),
            shared=self.shared,
            info=state.policy_info,
            inputs=self._inputs(state),
        )

    def record_inputs(
        self,
        state: LayerState,
        module: torch.nn.Module,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> None:
        """Keep what the attention layer was given (``[B, q, d]`` and its RoPE), for a policy observing "inputs".

        Kept from the layer's last event until the next, and only until the context ends (a policy that
        runs the model's own code on the layer -- a kvpress press -- compresses the context once).
        """
        if Observation.INPUTS not in self.policy.observes or state.context_ended:
            return
        inputs = state.inputs
        inputs["module"] = weakref.ref(module)
        inputs.setdefault("hidden_states", []).append(hidden_states.detach())
        if position_embeddings is not None:
            inputs.setdefault("position_embeddings", []).append(tuple(t.detach() for t in position_embeddings))

    def _inputs(self, state: LayerState) -> AttentionInputs | None:
        """The "inputs" observation as :class:`RowsView` gives it: the module and the forwards' inputs joined."""
        recorded = state.inputs
        if not recorded:
            return None
        # the rows appended since the last event; a forward still in flight (generate's first decode step, which
        # ends the context before its own row is appended) recorded its input already: left out
        rows = state.store.since_event
        hidden_states = torch.cat(recorded["hidden_states"], dim=1)[:, :rows]
        position_embeddings = None
        if "position_embeddings" in recorded:
            cos, sin = zip(*recorded["position_embeddings"])
            position_embeddings = (torch.cat(cos, dim=1)[:, :rows], torch.cat(sin, dim=1)[:, :rows])
        return AttentionInputs(recorded["module"](), hidden_states, position_embeddings)

    def record_queries(self, state: LayerState, query: torch.Tensor | None) -> None:
        """Keep the latest ``observation_window`` queries ``[B, H, w, D]`` (for window attention), until the
        context ends (after it, no event reads them: a decode step records nothing)."""
        window = self.observation_window
        if window <= 0 or query is None or state.context_ended:
            return
        query = query[:, :, -window:]
        joined = query if state.window_queries is None else torch.cat([state.window_queries, query], dim=2)
        state.window_queries = joined[:, :, -window:].detach()

    # --- a row's fate -----------------------------------------------------------------------------
    def budget(self, state: LayerState) -> int | None:
        """The layer's budget: resolved once, from the whole context when the cache knows its length.

        The policy checks the resolved number as it checks a ``budget=`` it is given
        (:meth:`~kvzoo.framework.policy.Policy.check_budget`): a ratio that leaves too few rows fails
        the same way a too-small budget does.
        """
        if state.budget is None:
            rows = max(state.store.seen, self.context_length or 0)
            budget = self.policy.resolve_budget(rows)
            if budget is not None:
                policy = self.policy
                source = ("budget" if policy.budget is not None else f"ratio={policy.ratio:g} of {rows} rows"
                          if policy.ratio is not None else f"{rows} rows")  # a policy with its own sizing (kvpress's)
                policy.check_budget(budget, source)
            state.budget = budget
        return state.budget

    def after_forward(self, state: LayerState) -> None:
        """Fire this forward's scheduled event for the layer, if the policy has one."""
        policy = self.policy
        store = state.store
        store.new_rows = 0
        if policy.schedule == "step":
            self.fire(state, "step")
        elif policy.schedule == "block" and policy.block_size and store.since_event >= policy.block_size:
            self.fire(state, "block")

    def fire(self, state: LayerState, event: Event) -> None:
        """Run the policy's selector for ``event`` and move the rows it does not keep."""
        try:
            self._fire(state, event)
        finally:
            state.inputs = {}  # the "inputs" observation covers the rows since the layer's last event

    def _fire(self, state: LayerState, event: Event) -> None:
        store = state.store
        policy = self.policy
        if event == "context_end":
            state.context_ended = True
        if not store.initialized or policy.is_dense(state.layer_rank):
            if event == "context_end":
                self._fit(state)
            return
        n = store.n
        target = policy.target_rows(
            event, budget=self.budget(state), resident=n, block_rows=min(store.since_event, n), seen=store.seen
        )
        if target is None or target >= n:
            store.since_event = 0
            if event != "step":  # a step that evicts nothing changes nothing (between events the storage stays)
                self._fit(state)
            return
        if event == "step" and target == n - 1:  # one in, one out: O(1) rows move when the policy can say which
            victim = policy.step_victim(self.view(state, ordered=False))
            if victim is not None:
                store.since_event = 0
                self._check_victim(store, victim)
                self._evict(state, store.row(victim), 1)  # an index out of range fails in this gather
                store.remove_one(victim)
                store.events += 1
                return
        rows = self.view(state)  # before since_event resets: the view marks where the closed block starts
        store.since_event = 0
        keep = policy.select(rows, target)
        self._check_keep(store, keep, target, n)
        self._evict(state, store.not_kept(keep), n - target)
        store.keep(keep)
        store.events += 1
        self._fit(state)

    def _fit(self, state: LayerState) -> None:
        """Fixed capacity, once the context has ended: the tier's storage holds the rows it has plus the most it
        can gain before the policy's next event (:meth:`Policy.rows_between_events`), never more than the rows
        still to come."""
        store = state.store
        if store.capacity is None or not state.context_ended or not store.initialized:
            return
        remaining = max(0, store.capacity - store.seen)
        gain = None if self.policy.is_dense(state.layer_rank) else self.policy.rows_between_events()
        store.fit_tier(store.n + (remaining if gain is None else min(gain, remaining)))

    def _check_keep(self, store: LayerStore, keep: torch.Tensor, target: int, n: int) -> None:
        B, G = store.get("keys").shape[:2]
        name = self.policy.name
        if keep.shape != (B, G, target) or keep.dtype != torch.long:
            raise RuntimeError(
                f"policy {name!r} select() must return int64 indices of shape {(B, G, target)}, "
                f"got {keep.dtype} {tuple(keep.shape)}"
            )
        if target:  # checked on the device: no host synchronisation
            ok = (keep.min() >= 0) & (keep.max() < n) & (keep.diff(dim=-1) > 0).all()
            torch._assert_async(ok, f"policy {name!r} select() returned indices that are out of range, unsorted or repeated")

    def _check_victim(self, store: LayerStore, victim: torch.Tensor) -> None:
        B, G = store.get("keys").shape[:2]
        if victim.shape != (B, G) or victim.dtype != torch.long:
            raise RuntimeError(
                f"policy {self.policy.name!r} step_victim() must return int64 indices of shape {(B, G)}, "
                f"got {victim.dtype} {tuple(victim.shape)}"
            )

    def _evict(self, state: LayerState, rows: dict[str, torch.Tensor], count: int) -> None:
        """Rows ``[B, G, count, ...]`` leaving the tier: indexed and archived, or dropped."""
        store = state.store
        if not self.policy.archive:
            store.drop(count)
            return
        if state.index is not None:  # index the rows before they leave (the block is still whole)
            self.retrieval.index(state, rows)
        store.add_to_archive(rows)

    # --- accounting ------------------------------------------------------------------------------------
    def account_attended(self, state: LayerState, queries: int = 1) -> None:
        """A forward that reads the attended tier only: host arithmetic, no device work."""
        store = state.store
        B, G = store.tier.buffers["keys"].shape[:2]
        attended = B * G * store.n * store.row_bytes()
        state.last_step = {"attended_bytes_read": attended, "kv_bytes_read": attended}
        state.attended_bytes_read += attended

    # --- reporting -----------------------------------------------------------------------------------
    def notes(self, states: list[LayerState]) -> list[str]:
        """What the figures alone would not tell: a block policy whose first block has not closed yet."""
        policy = self.policy
        open_rows = [s.store.since_event for s in states if s.store.events == 0 and not policy.is_dense(s.layer_rank)]
        if policy.schedule == "block" and open_rows and max(open_rows) and not any(s.context_ended for s in states):
            return [f"{policy.name}: no block has closed yet ({max(open_rows)} rows wait in an open block of "
                    f"{policy.block_size}): nothing is compressed until a block fills or compress() is called "
                    "(kvzoo.pipeline calls it after the context; model.generate compresses at the prompt's end)"]
        return []

    def layer_stats(self, state: LayerState) -> LayerStats:
        store = state.store
        fetched = _number(state.fetched_rows)
        info = {k: _number(v) for k, v in state.policy_info.items()}
        per_row = store.row_bytes() if store.initialized else 0
        fetched_bytes = fetched * per_row
        if "retrieval_steps" in info:  # cumulative reads of the retrieval tier, derived here from the counts
            info.update(rows_fetched=fetched, fetched_bytes=fetched_bytes, attended_bytes_read=state.attended_bytes_read,
                        index_bytes_scanned=state.index_bytes_scanned)
        return LayerStats(
            layer=state.layer_idx,
            seen_rows=store.seen,
            resident_rows=store.n,
            peak_resident_rows=store.peak_rows,
            resident_bytes=store.tier.nbytes(("keys", "values")) if store.initialized else 0,
            archived_rows=store.archive.n,
            archived_bytes=store.archive.nbytes(("keys", "values", "slots")) if store.initialized else 0,
            dropped_rows=store.dropped_rows,
            events=store.events,
            fetched_rows=fetched,
            kv_bytes_read=state.attended_bytes_read + state.index_bytes_scanned + fetched_bytes,
            policy_info=info,
            last_step={k: _number(v) for k, v in figures(state.last_step).items()},
        )
