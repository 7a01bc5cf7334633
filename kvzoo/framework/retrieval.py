"""The retrieval tier's mechanics: what a forward fetches from a layer's archive, and what it read.

A :class:`Retrieval` (one per cache) asks the layer's index which archived rows the queries need (``choose``),
hands them to the attention where they lie, and records what the forward read. A decode step
(:meth:`Retrieval.fetch_step`) gets one source of the decode op, no host synchronisation; a multi-token forward
(:meth:`Retrieval.fetch_forward`) reads by ``Retriever.multi_token``: the whole archive (``"dense"``) or the union
of each query's choice, scanned in query tiles (``"union"``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kvzoo.framework.buffers import gather_rows
from kvzoo.framework.names import build_retriever
from kvzoo.framework.retriever import ArchiveView, Choice, RetrievalState, Retriever, RowGeometry
from kvzoo.kernels.attention import query_block, row_mask
from kvzoo.kernels.decode_attention import Rows
from kvzoo.kernels.index_scan import exact_scores

if TYPE_CHECKING:  # a type name only: a layer is handed in
    from kvzoo.framework.layer import KVLayer


@dataclass
class Fetched:
    """Archived rows a multi-token forward reads, gathered: ``[B, G, f, ...]``; ``valid`` False on unused rows."""

    keys: torch.Tensor
    values: torch.Tensor | None  # GQA values; None on MLA (the latent row is both)
    slots: torch.Tensor
    valid: torch.Tensor
    dense: bool = False  # the whole archive, in archive order (a multi-token forward under the "dense" rule)


def _compact(mask: torch.Tensor, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``capacity`` set positions of ``mask [B, G, m]`` in order (placed by a prefix count, no sort):
    indices and a picked flag."""
    B, G, m = mask.shape
    position = mask.long().cumsum(-1) - 1
    target = torch.where(mask & (position < capacity), position, capacity)  # overflow goes to a spare slot
    idx = torch.zeros(B, G, capacity + 1, dtype=torch.long, device=mask.device)
    idx.scatter_(2, target, torch.arange(m, device=mask.device).expand(B, G, m))
    picked = torch.arange(capacity, device=mask.device) < mask.sum(-1, keepdim=True)
    return idx[..., :capacity], picked


def scan(
    state: RetrievalState,
    query: torch.Tensor,
    best: Callable[[int, int], torch.Tensor] | None,
    scaling: float,
    archive: ArchiveView,
    *,
    tile: int | None = None,
) -> torch.Tensor:
    """The rows some query of ``query [B, H, q, D]`` names: bool ``[B, G, m]``, padding excluded. The queries are
    scanned ``tile`` at a time (one tile of bounds at once); ``best(start, stop)`` gives their s*."""
    B, H, q_len, _ = query.shape
    m = archive.rows
    tile = tile or query_block(B * H, m)
    mask = None
    for start in range(0, q_len, tile):
        stop = min(start + tile, q_len)
        tile_best = best(start, stop) if state.needs_best else None
        chosen = state.choose(query[:, :, start:stop], tile_best, scaling, archive).as_mask(m)
        mask = chosen if mask is None else mask.logical_or_(chosen)
    return mask & archive.valid


def read_figures(read: dict[str, Any], batch_groups: int, row_bytes: int) -> dict[str, Any]:
    """A forward's reads (what :meth:`Retrieval.fetch_step` and friends recorded, in rows) as the figures
    ``stats()`` reports: KV-path bytes of the tier, the index and the fetched rows, and their sum."""
    if not read:
        return {}
    attended = batch_groups * read["tier_rows"] * row_bytes
    if "rows_fetched" not in read:
        return {"attended_bytes_read": attended, "kv_bytes_read": attended}
    fetched = read["rows_fetched"]
    out = {k: v for k, v in read.items() if k != "tier_rows"}
    out.update(attended_bytes_read=attended, fetched_bytes=fetched * row_bytes,
               rows_fetched_per_query=fetched / max(1, read["queries"]))
    out["kv_bytes_read"] = attended + read["index_bytes_scanned"] + out["fetched_bytes"]
    return out


@dataclass(frozen=True)
class Retrieval:
    """The retriever a cache runs with and whether it audits: fetching and accounting."""

    retriever: Retriever
    audit: bool = False  # every retrieval also scores all archived rows exactly (bound violations, recall)

    def new_state(self, geometry: RowGeometry) -> RetrievalState:
        return self.retriever.new_state(geometry)

    # --- a decode step --------------------------------------------------------------------------------
    def fetch_step(self, layer: KVLayer, query: torch.Tensor, best: torch.Tensor | None, scaling: float) -> Rows:
        """The archived rows the retriever names for one decode query per sequence (``query [B, H, 1, D]``; ``best
        [B, H, 1]`` its s*), as a source of the decode op: the layer's storage at their positions, each row once. No
        host synchronisation; with a fixed capacity the same shapes every step (the archive list read whole)."""
        store = layer.store
        index = store.archive.index
        view = store.archive.view(store.budget, whole=True, step=True)  # with the archive list, the fetched count
        choice = index.choose(query, best if index.needs_best else None, scaling, view)
        if choice.rows is None:  # a mask over the whole archive list
            positions = view.positions
        elif choice.positions is not None:  # the choice's op read the rows' storage positions itself
            positions = choice.positions
        else:
            positions = view.positions.gather(2, choice.rows)
        fetched = choice.count if choice.count is not None else choice.ok.sum()
        self._account(layer, query, scaling, fetched, choice, view, best)
        rows = store.rows
        width = None if "values" in rows.buffers else store.latent_width
        pool_valid = None if store.all_valid else rows.buffers["valid"]  # padding rows are never fetched
        return Rows(rows.buffers["keys"], rows.buffers.get("values"), value_width=width, indices=positions,
                    valid=choice.ok, head_valid=choice.head_valid, pool_valid=pool_valid)

    # --- a multi-token forward ---------------------------------------------------------------------------
    def fetch_forward(self, layer: KVLayer, query: torch.Tensor, scaling: float) -> Fetched:
        """The archived rows a forward of several queries (``query [B, H, q, D]``) reads, by the retriever's
        ``multi_token`` rule (module docstring), gathered with their slots (for the causal mask)."""
        store = layer.store
        index = store.archive.index
        q_len = query.shape[2]
        view = store.archive.view(store.budget)
        m = view.rows
        dense = self.retriever.multi_token == "dense"
        if dense:  # the reference's rule for a forward of several queries: read the whole archive
            picked = view.valid
            keys, slots = view.keys, view.slots
            values = store.archive.get("values") if "values" in store.rows.buffers else None
            fetched = picked.sum()
        else:
            q_slots = torch.arange(layer.counts.seen - q_len, layer.counts.seen, device=query.device)

            def best_of(start: int, stop: int) -> torch.Tensor:
                return tier_best(layer, query[:, :, start:stop], q_slots[start:stop], scaling)

            mask = scan(index, query, best_of, scaling, view)
            idx, picked = _compact(mask, min(m, int(mask.sum(-1).max())))  # a prefill may synchronise
            positions = store.archive.positions.get("pos").gather(2, idx)
            buffers = store.rows.buffers
            keys = gather_rows(buffers["keys"], positions)
            slots = gather_rows(buffers["slots"], positions)
            picked = picked & gather_rows(buffers["valid"], positions)  # padding rows are never fetched
            values = gather_rows(buffers["values"], positions) if "values" in buffers else None
            fetched = picked.sum()
        self._account(layer, query, scaling, fetched, None if dense else Choice(None, mask), view)
        return Fetched(keys, values, torch.where(picked, slots, -1), picked, dense=dense)

    # --- accounting --------------------------------------------------------------------------------------
    def _account(self, layer: KVLayer, query: torch.Tensor, scaling: float, fetched: torch.Tensor,
                 chosen: Choice | None, view: ArchiveView, best: torch.Tensor | None = None) -> None:
        """This forward's reads, in rows and entries: a few host numbers and device counts (the rows fetched,
        already added to the layer's count when the choice's op did it; the index bytes where the choice counted
        them); ``stats()`` derives bytes and figures from them. ``chosen`` None: the dense rule, which reads the
        archive, not the index."""
        index = layer.store.archive.index
        B, G = layer.store.rows.buffers["keys"].shape[:2]
        entries, index_bytes = index.scan_cost(query.shape[1] // G * query.shape[2]) if chosen is not None else (0, 0)
        entries, index_bytes = B * G * entries, B * G * index_bytes
        n = layer.store.n
        counts = layer.counts
        if chosen is not None and chosen.index_bytes is not None:  # a data-dependent scan: its own count
            index_bytes = chosen.index_bytes
            counts.index_bytes_counted.add_(index_bytes)  # in place, as the fetched rows
        else:
            counts.index_bytes_scanned += index_bytes  # + the fetched rows' bytes, derived by stats()
        counts.last_read = {"tier_rows": n, "queries": query.shape[2], "rows_scanned": entries,
                            "rows_fetched": fetched, "index_bytes_scanned": index_bytes}
        counts.tier_rows_read += n
        counts.retrieval_steps += 1
        counts.rows_scanned += entries
        if chosen is None or not chosen.counted:
            counts.fetched_rows.add_(fetched)  # in place: one device add per step, the counter's storage stays
        if self.audit and chosen is not None:
            audit = _audit(query, scaling, index, chosen.as_mask(view.rows), view, best)
            counts.last_read.update(audit)
            info = counts.policy_info
            for key, value in audit.items():
                info[key] = info.get(key, 0) + value


def tier_best(layer: KVLayer, query: torch.Tensor, q_slots: torch.Tensor, scaling: float) -> torch.Tensor:
    """s* ``[B, H, q]``: each query's best exact score over the rows of the attended tier it may read, in the decode
    op's score precision (``kvzoo/kernels/decode_attention``: the query rounded to the rows' dtype, fp32 products),
    so a multi-token forward and a decode step floor the retrieval at the same s*."""
    keys = layer.store.get("keys")
    scores = exact_scores(query.to(keys.dtype), keys, scaling)  # [B, H, q, n]
    B, H, q_len, n = scores.shape
    G = keys.shape[1]
    allowed = row_mask(layer.store.get("slots"), layer.store.get("valid"), q_slots)[:, :, None]
    allowed = allowed.expand(B, G, H // G, q_len, n).reshape(scores.shape)
    return scores.masked_fill(~allowed, float("-inf")).amax(dim=-1)


def _audit(query, scaling, index, mask, view, s_star=None) -> dict[str, float]:
    """Exact scores of every archived row, tile by tile: bound violations and recall of the true top rows (and, for
    a decode step, the index's own figures: :meth:`RetrievalState.audit_step`)."""
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
            rows = torch.arange(m, device=best.device)
            shift = index.page_shift  # [B, G] or None: pages from each sequence's first real row
            page = rows // size if shift is None else (rows + shift[..., None]) // size  # [m] or [B, G, m]
            pages = bounds.shape[-1]
            page = page.clamp(max=pages - 1).expand(B, G, m)
            page = page[:, :, None, None].expand(B, G, hpg, t, m).reshape(B, H, t, m)
            best = best.new_full((B, H, t, pages), float("-inf")).scatter_reduce_(-1, page, best, "amax")
        else:
            bounds = bounds[..., :m]  # a fixed index may hold spare entries
        out["bound_violations"] += int((bounds < best).sum())
        top = min(index.audit_top, m)
        if top:
            true_top = exact.masked_fill(~ok, float("-inf")).topk(top, dim=-1).indices  # [B,H,t,top]
            fetched = mask[:, :, None, None, :].expand(B, G, hpg, t, m).reshape(B, H, t, m)
            out["recall_hits"] += int((fetched.gather(-1, true_top) & ok.gather(-1, true_top)).sum())
            out["recall_total"] += int(ok.gather(-1, true_top).sum())
        if s_star is not None and q_len == 1:  # a decode step (one tile)
            for key, value in index.audit_step(q_tile, s_star, scaling, exact, view.valid).items():
                out[key] = out.get(key, 0) + value
    if index.audit_top == 0:
        del out["recall_hits"], out["recall_total"]
    return out


__all__ = ["ArchiveView", "Choice", "Fetched", "RetrievalState", "Retrieval", "Retriever", "RowGeometry",
           "build_retriever", "read_figures", "scan", "tier_best"]
