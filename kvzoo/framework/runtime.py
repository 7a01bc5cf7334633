"""The runtime: the one place a row's fate is decided, and the retrieval tier's mechanics.

A :class:`Runtime` (one per cache) holds the policy, the retriever configuration and what the
model's geometry says; each layer keeps a :class:`LayerState` beside its store. After a forward's
attention (``framework/attention.py``) the runtime fires the policy's schedule for the layer
(:meth:`Runtime.after_forward`): it resolves the layer's budget once (from the whole context when
the cache knows its length), asks the policy how many rows stay, calls the selector, moves the
rows it does not keep to the archive (indexing them for the retriever) or drops them, and counts.
During attention it scans the retriever's index and stages the archived rows a forward needs
(:meth:`Runtime.fetch`), and keeps the KV-path accounting and, with ``audit=True``, the audit.

Bounded memory: an index scan runs over the forward's queries in tiles
(:func:`kvzoo.kernels.attention.query_block`): no more than one tile of ``heads x queries x rows``
scores exists at a time, and what crosses tiles is one bool per archived row.

Multi-token forwards (a prefill chunk, a question, a teacher-forced answer) follow one rule for
every retriever (:class:`~kvzoo.framework.retriever.Retriever`'s ``multi_token``): ``"dense"``
(default, Quest's reference) reads the whole archive; ``"union"`` fetches the union of each
query's own choice. A decode step (one query) stages the retriever's candidates at a fixed count
per (batch, group), each row once -- no host synchronisation.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from kvzoo.framework.policy import Event, Policy, RowsView
from kvzoo.framework.retriever import ArchiveView, RetrievalState, Retriever, RowGeometry
from kvzoo.framework.store import LayerStats, LayerStore
from kvzoo.kernels.attention import query_block, row_mask, window_attention
from kvzoo.kernels.index_scan import exact_scores


@dataclass
class LayerState:
    """What the runtime keeps for one layer beside its rows: the budget, the index, the accounting."""

    layer_idx: int
    layer_rank: int  # index among the layers kvzoo compresses (Kimi Linear: MLA layers only)
    store: LayerStore = field(default_factory=LayerStore)
    index: RetrievalState | None = None  # the retriever's state over this layer's archive
    budget: int | None = None  # fixed at the first event
    scaling: float | None = None  # the attention's softmax scale (for the observation window)
    window_queries: torch.Tensor | None = None  # [B, H, w, D], the latest queries
    fetched_rows: int | torch.Tensor = 0  # a device tensor once rows are fetched (read by stats())
    attended_bytes_read: int = 0  # every forward: bytes of the tier it attended (host arithmetic)
    index_bytes_scanned: int = 0  # every forward: bytes of index entries it scanned
    policy_info: dict[str, Any] = field(default_factory=dict)  # the policy's and retriever's counters
    last_step: dict[str, Any] = field(default_factory=dict)  # the latest forward's KV-path accounting
    context_ended: bool = False  # the context_end event fired (compress(), or the prompt's end in generate)
    # the "inputs" observation since the layer's last event: the attention module (a weak reference: the cache never
    # keeps the model alive, and fork() never copies it) and its input hidden states / RoPE (cos, sin) per forward
    inputs: dict[str, Any] = field(default_factory=dict)


@dataclass
class Fetched:
    """Archived rows staged for one forward: ``[B, G, f, ...]``; ``valid`` False on unused staging rows."""

    keys: torch.Tensor
    values: torch.Tensor | None  # GQA values; None on MLA (the latent row is both)
    slots: torch.Tensor | None
    valid: torch.Tensor
    head_valid: torch.Tensor | None = None  # [B, H, f]: rows each query head may read (None: all of valid)
    dense: bool = False  # the whole archive, in archive order (a multi-token forward under the "dense" rule)


def _compact(mask: torch.Tensor, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``capacity`` set positions of ``mask [B, G, m]`` in order: indices and a picked flag.

    A prefix count places each set position; no sort.
    """
    B, G, m = mask.shape
    position = mask.long().cumsum(-1) - 1
    target = torch.where(mask & (position < capacity), position, capacity)  # overflow goes to a spare slot
    idx = torch.zeros(B, G, capacity + 1, dtype=torch.long, device=mask.device)
    idx.scatter_(2, target, torch.arange(m, device=mask.device).expand(B, G, m))
    picked = torch.arange(capacity, device=mask.device) < mask.sum(-1, keepdim=True)
    return idx[..., :capacity], picked


def _unique(rows: torch.Tensor, ok: torch.Tensor, archived: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Candidates ``[B, G, K]`` with each chosen row kept once: sorted indices and a picked flag.

    Unchosen candidates become ``archived`` (past every row), the ``K`` indices are sorted, and
    the first copy of each chosen row is picked. ``O(K log K)``, independent of the archive.
    """
    idx = torch.where(ok, rows, archived).sort(dim=-1).values
    picked = idx < archived
    picked[..., 1:] &= idx[..., 1:] != idx[..., :-1]
    return idx.clamp_(max=archived - 1), picked


def scan(
    state: RetrievalState,
    query: torch.Tensor,
    best: Callable[[int, int], torch.Tensor] | None,
    scaling: float,
    archive: ArchiveView,
    *,
    tile: int | None = None,
) -> torch.Tensor:
    """The rows some query of ``query [B, H, q, D]`` names: bool ``[B, G, m]``, padding excluded.

    The queries are scanned ``tile`` at a time (default: as many as fit one score block,
    :func:`~kvzoo.kernels.attention.query_block`), so no more than one tile of bounds exists at
    once, and the tiles' choices are OR-ed into one bool per archived row. ``best(start, stop)``
    returns s* ``[B, H, stop - start]`` for those queries (None when the state does not read it).
    """
    B, H, q_len, _ = query.shape
    m = archive.keys.shape[2]
    tile = tile or query_block(B * H, m)
    mask = None
    for start in range(0, q_len, tile):
        stop = min(start + tile, q_len)
        tile_best = best(start, stop) if state.needs_best else None
        chosen = state.choose(query[:, :, start:stop], tile_best, scaling, archive).as_mask(m)
        mask = chosen if mask is None else mask.logical_or_(chosen)
    return mask & archive.valid


def figures(step: dict[str, Any]) -> dict[str, Any]:
    """A forward's accounting with the derived figures: rows and bytes fetched, KV-path bytes read.

    ``step`` holds what the forward recorded (host numbers and the device count ``rows_fetched``);
    called by ``stats()``, outside the decode step, where reading the device count is fine.
    """
    out = {k: v for k, v in step.items() if k != "row_bytes"}
    if "rows_fetched" in step:
        fetched = step["rows_fetched"]
        out["fetched_bytes"] = fetched * step["row_bytes"]
        out["rows_fetched_per_query"] = fetched / max(1, step["queries"])
        out["kv_bytes_read"] = step["attended_bytes_read"] + step["index_bytes_scanned"] + out["fetched_bytes"]
    return out


def _number(value: Any) -> float:
    """A counter as a Python number (device tensors are read here, outside the decode step)."""
    if isinstance(value, torch.Tensor):
        value = value.item()
    return int(value) if float(value).is_integer() else float(value)


@dataclass
class Runtime:
    """The policy, the retriever and the model's geometry a cache runs with; per-cache state.

    ``geometry`` describes the rows (layout, latent and branch widths); ``num_layers`` counts the
    layers kvzoo compresses; ``context_length`` (when the pipeline knows it) makes a ratio budget
    count the whole context; ``audit`` scores every archived row exactly at each retrieval.
    """

    policy: Policy
    retriever: Retriever | None
    geometry: RowGeometry
    num_layers: int
    context_length: int | None = None
    audit: bool = False
    shared: dict[str, Any] = field(default_factory=dict)  # the policy's cross-layer scratch (ChunkKV's reuse)
    # queries kept beyond the policy's own window: a prefill that policies with wider windows continue from
    # (TieredCache(..., record_window=w) and fork_as); the policy itself sees only its own window's
    record_window: int = 0

    @property
    def observation_window(self) -> int:
        """How many of the latest queries each layer keeps: the policy's window, or ``record_window`` if wider."""
        return max(self.policy.observation_window, self.record_window)

    def new_layer(self, layer_idx: int, layer_rank: int) -> LayerState:
        index = self.retriever.new_state(self.geometry) if self.retriever is not None else None
        return LayerState(layer_idx, layer_rank, index=index)

    # --- the rows the selector sees ---------------------------------------------------------------
    def view(self, state: LayerState, ordered: bool = True) -> RowsView:
        """The attended tier as a :class:`RowsView` (``ordered=False``: as stored, for ``step_victim``)."""
        store = state.store
        if ordered:
            store.ensure_order()
        keys, slots, valid = store.get("keys"), store.get("slots"), store.get("valid")
        window_fn = None
        if "window" in self.policy.observes and state.window_queries is not None:
            queries = state.window_queries[:, :, -self.policy.observation_window:]
            q_slots = torch.arange(store.seen - queries.shape[2], store.seen, device=keys.device)
            scaling = state.scaling

            def window_fn() -> torch.Tensor:  # w x n, computed only if the selector reads it
                return window_attention(queries, q_slots, keys, slots, valid, scaling)

        return RowsView(
            keys=keys,
            values=store.get("values") if "values" in store.tier else None,
            slots=slots,
            valid=valid,
            layer_idx=state.layer_idx,
            num_layers=self.num_layers,
            layout=self.geometry.layout,
            layer_rank=state.layer_rank,
            branch_dim=self.geometry.branch_dim,
            first_new=max(0, store.n - store.since_event),
            window_fn=window_fn,
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
        if "inputs" not in self.policy.observes or state.context_ended:
            return
        inputs = state.inputs
        inputs["module"] = weakref.ref(module)
        inputs.setdefault("hidden_states", []).append(hidden_states.detach())
        if position_embeddings is not None:
            inputs.setdefault("position_embeddings", []).append(tuple(t.detach() for t in position_embeddings))

    def _inputs(self, state: LayerState) -> dict[str, Any]:
        """The "inputs" observation as :class:`RowsView` gives it: the module and the forwards' inputs joined."""
        recorded = state.inputs
        if not recorded:
            return {}
        # the rows appended since the last event; a forward still in flight (generate's first decode step, which
        # ends the context before its own row is appended) recorded its input already: left out
        rows = state.store.since_event
        out: dict[str, Any] = {"module": recorded["module"](),
                               "hidden_states": torch.cat(recorded["hidden_states"], dim=1)[:, :rows]}
        if "position_embeddings" in recorded:
            cos, sin = zip(*recorded["position_embeddings"])
            out["position_embeddings"] = (torch.cat(cos, dim=1)[:, :rows], torch.cat(sin, dim=1)[:, :rows])
        return out

    def record_queries(self, state: LayerState, query: torch.Tensor | None) -> None:
        """Keep the latest ``observation_window`` queries ``[B, H, w, D]`` (for window attention)."""
        window = self.observation_window
        if window <= 0 or query is None:
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
            return
        n = store.n
        target = policy.target_rows(
            event, budget=self.budget(state), resident=n, block_rows=min(store.since_event, n), seen=store.seen
        )
        if target is None or target >= n:
            store.since_event = 0
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
            view = ArchiveView(store.archive.get("keys"), store.archive.get("slots"), store.archive.get("valid"),
                               state.budget)
            state.index.index(rows, store.get("keys"), store.get("valid"), view)
        store.add_to_archive(rows)

    # --- retrieval ----------------------------------------------------------------------------------
    def account_attended(self, state: LayerState) -> None:
        """A forward that reads the attended tier only: host arithmetic, no device work."""
        store = state.store
        B, G = store.tier.buffers["keys"].shape[:2]
        attended = B * G * store.n * store.row_bytes()
        state.last_step = {"attended_bytes_read": attended, "kv_bytes_read": attended}
        state.attended_bytes_read += attended

    def tier_best(self, state: LayerState, query: torch.Tensor, q_slots: torch.Tensor, scaling: float) -> torch.Tensor:
        """s* ``[B, H, q]``: each query's best exact score over the rows of the attended tier it may read."""
        store = state.store
        keys = store.get("keys")
        scores = exact_scores(query, keys, scaling)  # [B, H, q, n]
        B, H, q_len, n = scores.shape
        G = keys.shape[1]
        allowed = row_mask(store.get("slots"), store.get("valid"), q_slots)[:, :, None]
        allowed = allowed.expand(B, G, H // G, q_len, n).reshape(scores.shape)
        return scores.masked_fill(~allowed, float("-inf")).amax(dim=-1)

    def fetch(
        self,
        state: LayerState,
        query: torch.Tensor,
        q_slots: torch.Tensor | None,
        scaling: float,
        best: torch.Tensor | None = None,
        *,
        with_slots: bool = True,
    ) -> Fetched | None:
        """Scan the layer's index for ``query [B, H, q, D]`` and stage the archived rows it names.

        ``q_slots [q]`` are the queries' slots (None: the forward's last ``q``). ``best [B, H, q]`` is
        s* when the caller already has it (the decode step computes the tier's scores anyway);
        otherwise it is computed per query tile. Returns None without a retriever or an archive.
        Records the forward's accounting in ``state.last_step`` and ``state.policy_info``.
        """
        index, store = state.index, state.store
        if index is None or store.archive.n == 0:
            return None
        q_len = query.shape[2]
        archive = store.archive
        m = archive.n
        view = ArchiveView(archive.get("keys"), archive.get("slots"), archive.get("valid"), state.budget)

        def best_of(start: int, stop: int) -> torch.Tensor:
            if best is not None:
                return best[:, :, start:stop]
            slots = q_slots if q_slots is not None else torch.arange(store.seen - q_len, store.seen, device=query.device)
            return self.tier_best(state, query[:, :, start:stop], slots[start:stop], scaling)

        choice = None
        dense = q_len > 1 and self.retriever.multi_token == "dense"
        if dense:  # the reference's rule for a forward of several queries: read the whole archive
            picked = view.valid.clone()
            idx = torch.arange(m, device=query.device).expand(*picked.shape)
        else:
            if q_len == 1:
                choice = index.choose(query, best_of(0, 1) if index.needs_best else None, scaling, view)
            if choice is not None and choice.rows is not None and choice.rows.shape[-1] <= m // 2:
                idx, picked = _unique(choice.rows, choice.ok, m)  # a decode step: stage the candidates as they are
            elif choice is not None:  # a mask, or more candidates than half the archive: a fixed capacity of m
                mask = choice.as_mask(m) & view.valid
                idx, picked = _compact(mask, m if choice.mask is None else int(mask.sum(-1).max()))
            else:
                mask = scan(index, query, best_of, scaling, view)
                idx, picked = _compact(mask, min(m, int(mask.sum(-1).max())))
        names = ("keys", "values") + (("slots",) if with_slots else ()) + (() if store.all_valid else ("valid",))
        rows = archive.gather(idx, names)  # a decode step needs no slots; an archive without padding no flags
        if "valid" in rows:
            picked = picked & rows["valid"]  # padding rows are never fetched
        head_valid = None
        if choice is not None and choice.visible is not None:
            H = query.shape[1]
            head_valid = choice.visible(idx) & picked.repeat_interleave(H // picked.shape[1], dim=1)
        fetched = Fetched(
            keys=rows["keys"],
            values=rows.get("values"),
            slots=torch.where(picked, rows["slots"], -1) if "slots" in rows else None,
            valid=picked,
            head_valid=head_valid,
            dense=dense,
        )
        self._account(state, query, scaling, idx, picked, view, scanned=not dense)
        return fetched

    def _account(self, state, query, scaling, idx, picked, view, *, scanned: bool) -> None:
        """This forward's KV-path reads: host numbers, plus one device count (the rows fetched)."""
        index, store = state.index, state.store
        B, G = picked.shape[:2]
        entries = index.entries() if scanned else 0  # the dense rule reads the archive, not the index
        fetched = picked.sum()  # a device tensor: read only by stats()
        per_row = store.row_bytes()
        attended = B * G * store.n * per_row
        index_bytes = B * G * entries * index.entry_bytes
        step: dict[str, Any] = {
            "queries": query.shape[2],
            "rows_scanned": B * G * entries,
            "rows_fetched": fetched,
            "attended_bytes_read": attended,
            "index_bytes_scanned": index_bytes,
            "row_bytes": per_row,
        }
        if self.audit:
            m = view.keys.shape[2]
            mask = torch.zeros(B, G, m + 1, dtype=torch.bool, device=picked.device)
            mask.scatter_(2, torch.where(picked, idx, m), True)
            step.update(_audit(query, scaling, index, mask[..., :-1], view))
        state.last_step = step
        state.attended_bytes_read += attended
        state.index_bytes_scanned += index_bytes  # + the fetched rows' bytes, derived by stats()
        info = state.policy_info
        info["retrieval_steps"] = info.get("retrieval_steps", 0) + 1
        for key in ("rows_scanned", "bound_violations", "recall_hits", "recall_total", "audited_scores"):
            if key in step:
                info[key] = info.get(key, 0) + step[key]
        state.fetched_rows = state.fetched_rows + fetched  # one device add per step

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


def _audit(query, scaling, index, mask, view) -> dict[str, float]:
    """Exact scores of every archived row, tile by tile: bound violations and recall of the true top rows."""
    B, H, q_len, _ = query.shape
    G, m = view.keys.shape[1], view.keys.shape[2]
    hpg = H // G
    out = {"audited_scores": 0, "bound_violations": 0, "recall_hits": 0, "recall_total": 0}
    size = index.page_size
    tile = query_block(B * H, m)
    for start in range(0, q_len, tile):
        q_tile = query[:, :, start : start + tile]
        t = q_tile.shape[2]
        exact = exact_scores(q_tile, view.keys, scaling)  # [B,H,t,m]
        ok = view.valid[:, :, None, None, :].expand(B, G, hpg, t, m).reshape(B, H, t, m)
        out["audited_scores"] += int(ok.sum())
        bounds = index.bounds(q_tile, scaling)
        best = exact.masked_fill(~ok, float("-inf"))
        if size > 1:  # per-page bounds: each must cover the best row of its page
            pages = bounds.shape[-1]
            padded = best.new_full((B, H, t, pages * size), float("-inf"))
            padded[..., :m] = best
            best = padded.view(B, H, t, pages, size).amax(-1)
        out["bound_violations"] += int((bounds < best).sum())
        top = min(index.audit_top, m)
        if top:
            true_top = exact.masked_fill(~ok, float("-inf")).topk(top, dim=-1).indices  # [B,H,t,top]
            fetched = mask[:, :, None, None, :].expand(B, G, hpg, t, m).reshape(B, H, t, m)
            out["recall_hits"] += int((fetched.gather(-1, true_top) & ok.gather(-1, true_top)).sum())
            out["recall_total"] += int(ok.gather(-1, true_top).sum())
    if index.audit_top == 0:
        del out["recall_hits"], out["recall_total"]
    return out
