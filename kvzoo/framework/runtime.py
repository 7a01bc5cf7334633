"""The runtime: the one place a row's fate is decided, and where the next decode step's kind is stated.

After a forward's attention, :meth:`Runtime.after_forward` fires the policy's schedule for the layer: the budget is
resolved once, the policy says how many rows stay, the selector chooses, the layer's storage moves the rest, and with
a fixed capacity the tier is sized for the next event. :meth:`Runtime.next_step` says from host counters alone what
a layer's next decode step does (for the CUDA-graph runner too). A layer is reached only through
:class:`~kvzoo.framework.layer.RuntimeLayer`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from kvzoo.framework.layer import RuntimeLayer
from kvzoo.framework.plugins import plugin_failed
from kvzoo.framework.policy import FRAMEWORK_VICTIMS, Event, Observation, Policy, check_schedule
from kvzoo.framework.retrieval import Retrieval
from kvzoo.framework.retriever import RetrievalState, RowGeometry

StepKind = Literal["steady", "one_in_one_out", "event"]


def rows_between_events(policy: Policy) -> int | None:
    """The most rows a layer's attended tier gains between two of ``policy``'s events after the context (None: it may
    grow until the sequence ends): the policy's ``rows_between_events`` where it states one, else what its schedule
    says -- one row for ``step`` (one in, one out), ``block_size`` for ``block``."""
    if policy.rows_between_events is not None:
        return policy.rows_between_events
    return {"step": 1, "block": policy.block_size}.get(policy.schedule)


@dataclass(frozen=True)
class RuntimeConfig:
    """What a cache runs with, fixed when it is made (a fork shares it; ``fork_as`` makes another)."""

    policy: Policy
    retrieval: Retrieval | None
    geometry: RowGeometry  # layout, latent and branch widths, the fixed capacity if any
    num_layers: int  # the layers kvzoo compresses
    # queries kept beyond the policy's own window and each row's attention accumulated whatever the policy: for a
    # prefill that other policies continue (TieredCache(..., record_window=w, record_attention=True), fork_as)
    record_window: int = 0
    record_attention: bool = False


@dataclass
class Runtime:
    """A cache's :class:`RuntimeConfig` (its fields read as the runtime's own) and its per-cache state: the context's
    length (a ratio budget counts the whole context), the policy's cross-layer scratch (``shared``: ChunkKV's reuse),
    and the layer whose rows went in and whose attention has not run yet (``pending``: a forward of a model that does
    not run kvzoo's attention is refused at its next layer)."""

    config: RuntimeConfig
    context_length: int | None = None
    shared: dict[str, Any] = field(default_factory=dict)
    pending: int | None = field(default=None, repr=False)
    # the forward in flight ends the context (TieredCache.context_end()): each layer compresses after its attention
    ending: bool = False
    # the forwards feed a prompt (TieredCache.prefilling()): a one-token forward is one of its chunks, not generate's
    # first decode step, so it does not end the context (KVLayer.update's auto_compress)
    prefilling: bool = False
    resident: int = 0  # rows the attended tiers of every layer hold now, per sequence and KV group
    peak_resident: int = 0  # the most they held at once

    def held(self, change: int) -> None:
        """A layer's tier gained (or lost) ``change`` rows: the cache-wide count and its peak."""
        self.resident += change
        if self.resident > self.peak_resident:
            self.peak_resident = self.resident

    # the configuration's fields and what follows from them, copied once (read per layer per step: a property is a
    # call each time)
    policy: Policy = field(init=False, repr=False)
    retrieval: Retrieval | None = field(init=False, repr=False)
    geometry: RowGeometry = field(init=False, repr=False)
    num_layers: int = field(init=False, repr=False)
    record_window: int = field(init=False, repr=False)
    retriever: Any = field(init=False, repr=False)
    audit: bool = field(init=False, repr=False)
    # the policy observes each row's accumulated attention, or the cache records it: the attention adds to it
    accumulates: bool = field(init=False, repr=False)
    observation_window: int = field(init=False, repr=False)  # the latest queries each layer keeps
    # the policy's step_victim() is its own, not one the framework wrote (whose victims are tier rows by construction):
    # each victim is checked to lie in the tier (on the device), as a row past it would be taken silently
    checks_victims: bool = field(init=False, repr=False)

    def __post_init__(self) -> None:
        config = self.config
        check_schedule(config.policy)
        self.policy, self.retrieval, self.geometry = config.policy, config.retrieval, config.geometry
        self.num_layers, self.record_window = config.num_layers, config.record_window
        self.retriever = config.retrieval.retriever if config.retrieval is not None else None
        self.audit = config.retrieval is not None and config.retrieval.audit
        self.accumulates = config.record_attention or Observation.ACCUMULATE in self.policy.observes
        self.observation_window = max(self.policy.observation_window, self.record_window)
        self.checks_victims = type(self.policy).step_victim not in FRAMEWORK_VICTIMS

    def new_index(self) -> RetrievalState | None:
        return self.retrieval.new_state(self.geometry) if self.retrieval is not None else None

    # --- a row's fate -----------------------------------------------------------------------------
    def resolve_budget(self, layer: RuntimeLayer) -> int | None:
        """The layer's budget: resolved once, from the whole context when the cache knows its length, and checked as a
        ``budget=`` given is (:meth:`~kvzoo.framework.policy.Policy.check_budget`)."""
        if layer.store.budget is None:
            rows = max(layer.counts.seen, self.context_length or 0)
            budget = self.policy.resolve_budget(rows)
            if budget is not None:
                policy = self.policy
                source = ("budget" if policy.budget is not None else f"ratio={policy.ratio:g} of {rows} rows"
                          if policy.ratio is not None else f"{rows} rows")  # a policy with its own sizing (kvpress's)
                policy.check_budget(budget, source)
            layer.store.budget = budget
        return layer.store.budget

    def next_step(self, layer: RuntimeLayer, ahead: int = 1) -> StepKind:
        """What the layer's decode step ``ahead`` steps from now does, the steps before it of the next step's kind, from
        host counters alone: ``"steady"`` (nothing leaves), ``"one_in_one_out"`` (one index moves) or ``"event"``."""
        if not layer.is_initialized or not layer.context_ended:
            return "event"  # the prompt's end (generate's first decode step) compresses
        kind = self._kind(layer, 0, "steady") if ahead == 1 else self.next_step(layer)
        return kind if ahead == 1 or kind == "event" else self._kind(layer, ahead - 1, kind)

    def _kind(self, layer: RuntimeLayer, before: int, kind: StepKind) -> StepKind:
        """The kind of the step that follows ``before`` steps of ``kind`` (:meth:`next_step`)."""
        policy, counts = self.policy, layer.counts
        one = kind == "one_in_one_out"
        n = layer.store.n + (1 if one or before == 0 else before + 1)  # the tier as the step sees it, its own row in
        seen = counts.seen + before + 1
        since = (1 if before else counts.since_event + 1) if one else counts.since_event + before + 1
        if layer.store.outgrows(n, before + 1, 0):
            return "event"  # the storage grows
        if layer.rank < policy.dense_layers:
            return "steady"
        if policy.schedule == "step":
            budget = layer.store.budget
            target = policy.target_rows("step", budget=budget, resident=n, block_rows=min(since, n), seen=seen)
            if target is None or target >= n:
                return "steady"
            if target != n - 1 or layer.store.outgrows(n, before + 1, (before if one else 0) + 1):
                return "event"  # a selection, or the archive grows
            return "one_in_one_out"
        if policy.schedule == "block" and since >= (policy.block_size or 0):
            return "event"
        return "steady"

    def run_of(self, layer: RuntimeLayer, limit: int) -> int:
        """How many of the layer's next decode steps (at most ``limit``) are of the next step's kind: what a captured
        step may be replayed for without asking again (0: the next is an event)."""
        kind = self.next_step(layer)
        if kind == "event":
            return 0
        steps = 1
        while steps < limit and self._kind(layer, steps, kind) == kind:
            steps += 1
        return steps

    def after_forward(self, layer: RuntimeLayer) -> int | None:
        """Fire this forward's scheduled event for the layer, if the policy has one; and, when the forward ends the
        context (:meth:`TieredCache.context_end`), the ``context_end`` event right after, before the next layer runs
        (so only one layer holds its whole prefill at a time). Returns the bytes that event gave back (None: the
        forward did not end the context), for the caller to give the heap's free pages back
        (:func:`kvzoo.framework.attention.after_forward`)."""
        policy, counts = self.policy, layer.counts
        if policy.schedule == "step":
            self.fire(layer, "step")
        elif policy.schedule == "block" and policy.block_size and counts.since_event >= policy.block_size:
            self.fire(layer, "block")
        if not self.ending:
            return None
        freed = self.fire(layer, "context_end")
        if layer.rank == self.num_layers - 1:  # the forward's last layer: the context has ended
            self.ending = False
        return freed

    def fire(self, layer: RuntimeLayer, event: Event) -> int:
        """Run the policy's selector for ``event`` and move the rows it does not keep; the bytes given back."""
        freed = 0
        try:
            policy, counts, store = self.policy, layer.counts, layer.store
            if event == "context_end":
                layer.context_ended = True
            if not layer.is_initialized or layer.rank < policy.dense_layers:
                if event == "context_end":
                    self._fit(layer)
                return freed
            if event != "step" and policy.schedule == "block" and policy.closes_each_block and policy.block_size:
                while counts.since_event > policy.block_size:  # a forward added more than a block: each closes alone
                    freed += self._close_block(layer, event, policy.block_size)
                if event == "block" and counts.since_event < policy.block_size:  # the rest stays open
                    self._fit(layer)
                    return freed
            n = store.n
            budget = store.budget if store.budget is not None else self.resolve_budget(layer)
            try:  # the policy's methods are a plugin's: a fault names it (a try costs nothing until it raises)
                target = policy.target_rows(event, budget=budget, resident=n, block_rows=min(counts.since_event, n),
                                            seen=counts.seen)
            except Exception as err:
                plugin_failed(policy, "policy", "target_rows", err)
            if target is None or target >= n:
                counts.since_event = 0
                if event != "step":  # a step that evicts nothing changes nothing (between events the storage stays)
                    self._fit(layer)
                return freed
            if event == "step" and target == n - 1:  # one in, one out: O(1) indices move when the policy can say which
                view = layer.rows_view(ordered=False)
                try:
                    victim = policy.step_victim(view)
                except Exception as err:
                    plugin_failed(policy, "policy", "step_victim", err)
                if victim is not None:
                    counts.since_event = 0
                    return store.evict(policy, victim=victim, tier=n if self.checks_victims else 0)
            rows = layer.rows_view()  # before since_event resets: the view marks where the closed block starts
            counts.since_event = 0
            try:
                keep = policy.select(rows, target)
            except Exception as err:
                plugin_failed(policy, "policy", "select", err)
            freed += store.evict(policy, keep=keep, target=target, end=n)
            self._fit(layer)
            return freed
        finally:
            layer.observed.drop_inputs()  # the "inputs" observation covers the rows since the layer's last event

    def _close_block(self, layer: RuntimeLayer, event: Event, block: int) -> int:
        """Close the first ``block`` of the rows since the layer's last event, as if the forward had ended there: the
        selector sees the tier up to the block's end, chooses among the block's rows, and every later row stays
        (they open the next block). The kept rows are those of a forward chunked at ``block`` rows; the bytes given
        back."""
        policy, counts, store = self.policy, layer.counts, layer.store
        n, open_rows = store.n, min(counts.since_event, store.n)
        end = n - open_rows + block  # the block is tier rows [n - open_rows, end)
        budget = self.resolve_budget(layer)
        try:
            target = policy.target_rows(event, budget=budget, resident=end, block_rows=block,
                                        seen=counts.seen - open_rows + block)
        except Exception as err:
            plugin_failed(policy, "policy", "target_rows", err)
        freed = 0
        if target is not None and target < end:
            rows = layer.rows_view(end=end)  # before since_event moves on: the view marks where the block starts
            try:
                keep = policy.select(rows, target)
            except Exception as err:
                plugin_failed(policy, "policy", "select", err)
            freed = store.evict(policy, keep=keep, target=target, end=end)
        counts.since_event -= block
        layer.observed.drop_inputs(block)  # the "inputs" observation covers the rows still open
        return freed

    def _fit(self, layer: RuntimeLayer) -> None:
        """Fixed capacity, once the context has ended: the tier's storage holds the rows it has plus the most it
        can gain before the policy's next event (:func:`rows_between_events`), never more than the rows still
        to come."""
        capacity = self.geometry.capacity
        if capacity is None or not layer.context_ended or not layer.is_initialized:
            return
        remaining = max(0, capacity - layer.counts.seen)
        gain = None if layer.rank < self.policy.dense_layers else rows_between_events(self.policy)
        layer.store.fit(layer.store.n + (remaining if gain is None else min(gain, remaining)))
