"""The retrieval tier's mechanics: index the rows a layer archives, scan, stage, account, audit.

A :class:`Retrieval` (one per cache, beside the :class:`~kvzoo.framework.runtime.Runtime` that decides a row's
fate) holds the retriever's configuration (``framework/retriever.py``: a dataclass that makes one
:class:`~kvzoo.framework.retriever.RetrievalState` per layer) and the audit flag. Per forward it scans the
layer's index with the forward's queries, stages the archived rows they name and records what the forward
read:

* a **decode step** (:meth:`Retrieval.fetch_step`) stages the retriever's candidates at a fixed count per
  (batch, group) -- each row once, no host synchronisation, and with ``TieredCache(..., capacity=N)`` the same
  shapes and storage every step (the archive and the index are read whole, their live counts on the device);
* a **multi-token forward** (:meth:`Retrieval.fetch_forward`: a prefill chunk, a question, a teacher-forced
  answer) follows one rule for every retriever (``Retriever.multi_token``): ``"dense"`` (default, Quest's
  reference) reads the whole archive; ``"union"`` fetches the union of each query's own choice, scanned in
  query tiles (:func:`kvzoo.kernels.attention.query_block`) so that no more than one tile of
  ``heads x queries x rows`` bounds exists at a time.

Also the retrieval tier's public names (the interfaces and building a retriever by name).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kvzoo.framework.layer_state import LayerState
from kvzoo.framework.names import build_retriever, retriever_names
from kvzoo.framework.retriever import ArchiveView, Choice, RetrievalState, Retriever, RowGeometry
from kvzoo.kernels.attention import query_block, row_mask
from kvzoo.kernels.index_scan import exact_scores

if TYPE_CHECKING:  # a type name only
    from kvzoo.framework.store import LayerStore

ROW_NAMES = ("keys", "values", "slots", "valid")


@dataclass
class Fetched:
    """Archived rows staged for one forward: ``[B, G, f, ...]``; ``valid`` False on unused staging rows."""

    keys: torch.Tensor
    values: torch.Tensor | None  # GQA values; None on MLA (the latent row is both)
    slots: torch.Tensor | None
    valid: torch.Tensor
    head_valid: torch.Tensor | None = None  # [B, H, f]: rows each query head may read (None: all of valid)
    dense: bool = False  # the whole archive, in archive order (a multi-token forward under the "dense" rule)


def archive_view(store: LayerStore, budget: int | None, *, whole: bool = False) -> ArchiveView:
    """The layer's archive as an :class:`ArchiveView` (tensors taken when read; ``whole``: the whole buffers of a
    fixed-capacity archive, as a decode step reads them)."""
    archive = store.archive
    return ArchiveView(budget=budget, read=archive.reading if whole else archive.get)


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


@dataclass(frozen=True)
class Retrieval:
    """The retriever a cache runs with and whether it audits: indexing, scanning, staging, accounting."""

    retriever: Retriever
    audit: bool = False  # every retrieval also scores all archived rows exactly (bound violations, recall)

    def new_state(self, geometry: RowGeometry) -> RetrievalState:
        return self.retriever.new_state(geometry)

    # --- indexing ----------------------------------------------------------------------------------
    def index(self, state: LayerState, rows: dict[str, torch.Tensor]) -> None:
        """Index ``rows`` (``[B, G, k, ...]``) as they leave the attended tier for the archive (the tier still
        holds them: the closing block is whole)."""
        store = state.store
        state.index.index(rows, store.get("keys"), store.get("valid"), archive_view(store, state.budget))

    # --- a decode step --------------------------------------------------------------------------------
    def fetch_step(self, state: LayerState, query: torch.Tensor, best: torch.Tensor | None,
                   scaling: float) -> Fetched:
        """Stage what the retriever names for one decode query per sequence (``query [B, H, 1, D]``).

        ``best [B, H, 1]`` is s* (the attended tier's best score), None when the state does not read it. The
        candidates are staged as they are, each row once, at the count the retriever gives (a mask choice --
        the certified mode -- at the archive's row count): no host synchronisation, and with a fixed capacity
        the same shapes from step to step.
        """
        index, store = state.index, state.store
        archive = store.archive
        view = archive_view(store, state.budget, whole=True)
        m = archive.capacity if archive.fixed else archive.n  # the archive rows the step reads
        choice = index.choose(query, best if index.needs_best else None, scaling, view)
        if choice.staged is not None:  # the retriever staged its choice itself (one fused scan)
            idx, picked = choice.staged
        elif choice.rows is not None:
            idx, picked = _unique(choice.rows, choice.ok, m)
        else:
            idx, picked = _compact(choice.as_mask(m) & view.valid, m)
        names = ("keys", "values") + (() if store.all_valid else ("valid",))  # a decode step needs no slots
        rows = archive.gather(idx, names)
        if "valid" in rows:
            picked = picked & rows["valid"]  # padding rows are never fetched
        head_valid = None
        if choice.visible is not None:
            H = query.shape[1]
            head_valid = choice.visible(idx) & picked.repeat_interleave(H // picked.shape[1], dim=1)
        self._account(state, query, scaling, idx, picked, view, scanned=True)
        return Fetched(rows["keys"], rows.get("values"), None, picked, head_valid)

    # --- a multi-token forward ---------------------------------------------------------------------------
    def fetch_forward(self, state: LayerState, query: torch.Tensor, scaling: float) -> Fetched:
        """Stage the archived rows a forward of several queries (``query [B, H, q, D]``) reads, by the
        retriever's ``multi_token`` rule (module docstring), with their slots (for the causal mask)."""
        index, store = state.index, state.store
        archive = store.archive
        q_len, m = query.shape[2], archive.n
        view = archive_view(store, state.budget)
        dense = self.retriever.multi_token == "dense"
        if dense:  # the reference's rule for a forward of several queries: read the whole archive
            picked = view.valid.clone()
            idx = torch.arange(m, device=query.device).expand(*picked.shape)
        else:
            q_slots = torch.arange(store.seen - q_len, store.seen, device=query.device)

            def best_of(start: int, stop: int) -> torch.Tensor:
                return tier_best(store, query[:, :, start:stop], q_slots[start:stop], scaling)

            mask = scan(index, query, best_of, scaling, view)
            idx, picked = _compact(mask, min(m, int(mask.sum(-1).max())))  # a prefill may synchronise
        names = ROW_NAMES if "values" in archive else ("keys", "slots", "valid")
        rows = archive.gather(idx, names)
        picked = picked & rows["valid"]  # padding rows are never fetched
        self._account(state, query, scaling, idx, picked, view, scanned=not dense)
        return Fetched(rows["keys"], rows.get("values"), torch.where(picked, rows["slots"], -1), picked,
                       dense=dense)

    # --- accounting --------------------------------------------------------------------------------------
    def _account(self, state, query, scaling, idx, picked, view, *, scanned: bool) -> None:
        """This forward's KV-path reads: host numbers, plus one device count (the rows fetched)."""
        index, store = state.index, state.store
        B, G = picked.shape[:2]
        entries = index.entries() if scanned else 0  # the dense rule reads the archive, not the index
        fetched = picked.sum()  # a device tensor: read only by stats()
        per_row = store.row_bytes()
        attended = B * G * store.n * per_row
        index_bytes = B * G * index.scan_bytes(query.shape[1] // G * query.shape[2]) if scanned else 0
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
        if state.fetched_rows.device != fetched.device:  # the layer's first retrieval: the counter moves once
            state.fetched_rows = state.fetched_rows.to(fetched.device)
        state.fetched_rows.add_(fetched)  # in place: one device add per step, the counter's storage stays


def tier_best(store: LayerStore, query: torch.Tensor, q_slots: torch.Tensor, scaling: float) -> torch.Tensor:
    """s* ``[B, H, q]``: each query's best exact score over the rows of the attended tier it may read."""
    keys = store.get("keys")
    scores = exact_scores(query, keys, scaling)  # [B, H, q, n]
    B, H, q_len, n = scores.shape
    G = keys.shape[1]
    allowed = row_mask(store.get("slots"), store.get("valid"), q_slots)[:, :, None]
    allowed = allowed.expand(B, G, H // G, q_len, n).reshape(scores.shape)
    return scores.masked_fill(~allowed, float("-inf")).amax(dim=-1)


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
        bounds = index.bounds(q_tile, scaling)[..., : -(-m // size)]  # a fixed index may hold spare entries
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


__all__ = ["ArchiveView", "Choice", "Fetched", "RetrievalState", "Retrieval", "Retriever", "RowGeometry",
           "archive_view", "build_retriever", "retriever_names", "scan", "tier_best"]
