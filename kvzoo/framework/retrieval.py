"""The retrieval tier: an index over each layer's archive that brings rows back for one forward.

A *retriever* (configuration, a dataclass) makes one *state* per layer. The state indexes rows as
they are archived (``index``) and, given queries, names the archived rows they could need
(``choose``). :func:`fetch` -- called by the attention path -- scans the index, gathers the named
rows from the archive, bit-exact, so that they join this forward's softmax as a second source
beside the attended tier, and keeps the accounting: rows scanned, rows fetched, KV-path bytes read
(attended rows + index entries scanned + fetched rows), and, with ``TieredCache(..., audit=True)``,
bound violations and the recall of the true top rows.

Bounded memory: the scan runs over the forward's queries in tiles
(:func:`kvzoo.kernels.attention.query_block`): no more than one tile of ``heads x queries x rows``
scores exists at a time, and what crosses tiles is one bool per archived row (the union of the
tiles' choices). A multi-token forward (a question, a prefill chunk) therefore fetches **the union
of every query's own choice**: each query names its rows (per head, by its own bound and its own
s*), and the forward attends over the union (each query still reads only rows at or before its
slot). The decode step (one query) stages the retriever's candidates as they come -- a fixed number
per (batch, group), e.g. ``j`` per head, each row once -- so it needs no host synchronisation.

Retrievers are named: ``"vestige"`` (certified sketch, ``policies/vestige.py``) and ``"quest"``
(page min/max, ``policies/quest.py``). Any selector combines with any retriever:
``registry.get("snapkv", retriever="vestige")``.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from kvzoo.kernels.attention import query_block, row_mask
from kvzoo.kernels.index_scan import exact_scores

if TYPE_CHECKING:
    from kvzoo.framework.cache import TieredLayer

RETRIEVERS: dict[str, str] = {
    "vestige": "kvzoo.policies.vestige:VestigeRetriever",
    "quest": "kvzoo.policies.quest:QuestRetriever",
}


def retriever_names() -> tuple[str, ...]:
    return tuple(RETRIEVERS)


def _retriever_class(name: str) -> type[Retriever]:
    if name not in RETRIEVERS:
        raise KeyError(f"unknown retriever {name!r}; valid: {', '.join(RETRIEVERS)}")
    module, _, cls = RETRIEVERS[name].partition(":")
    return getattr(importlib.import_module(module), cls)


def check_retriever_params(policy: Any, retriever: Retriever | None) -> None:
    """ValueError when a retriever object disagrees with a setting the policy also holds."""
    if retriever is None:
        return
    for name, value in policy.retriever_params().items():
        if name in getattr(retriever, "__dataclass_fields__", {}) and getattr(retriever, name) != value:
            raise ValueError(
                f"policy {policy.name!r} has {name}={value!r} but its retriever has {name}={getattr(retriever, name)!r}; "
                f"give the retriever by name (retriever={retriever.name!r}) to take the policy's, or make them equal"
            )


def build_retriever(spec: str | Retriever | None, **params: Any) -> Retriever | None:
    """A configured retriever from a name (with ``params``), a Retriever object, or None."""
    if spec is None or isinstance(spec, Retriever):
        if params:
            raise TypeError("retriever parameters need a retriever name")
        return spec
    cls = _retriever_class(spec)
    fields = set(cls.__dataclass_fields__)
    unknown = sorted(set(params) - fields)
    if unknown:
        raise TypeError(f"retriever {spec!r}: unknown parameter(s) {unknown}; valid: {sorted(fields)}")
    return cls(**params)


@dataclass
class RowGeometry:
    """What a retrieval state needs to know about the rows it indexes."""

    layout: str  # "gqa" or "mla"
    content_dim: int  # MLA: the latent c's width (512); GQA: 0 (the whole key is content)
    branch_dim: int = 0  # MLA: the decoupled branch r's width (64); GQA: 0


@dataclass
class ArchiveView:
    """One layer's archive as tensors (what a retriever may read at scan time)."""

    keys: torch.Tensor  # [B, G, m, D] archived keys (MLA: latent rows)
    slots: torch.Tensor  # [B, G, m]
    valid: torch.Tensor  # [B, G, m]
    budget: int | None  # the layer's budget (rows), fixed at its first event


class RetrievalState(ABC):
    """One layer's index over its archive."""

    entry_bytes: int = 0  # bytes of one index entry
    page_size: int = 1  # archived rows one entry covers (Quest's pages; 1 for per-row indexes)
    needs_best: bool = True  # choose() reads s*, the attended tier's best score per head and query
    audit_top: int = 0  # how many true top rows the audit's recall looks at

    @abstractmethod
    def index(
        self, rows: dict[str, torch.Tensor], block_keys: torch.Tensor, block_valid: torch.Tensor, archive: ArchiveView
    ) -> None:
        """Index ``rows`` (``keys [B,G,k,D]``, ``valid``, ...) as they join the end of ``archive``.

        ``block_keys``/``block_valid`` are the attended tier before the eviction (the closing block);
        ``archive`` is the archive before ``rows`` join it (to rebuild an index).
        """

    @abstractmethod
    def entries(self) -> int:
        """Index entries per (batch, group): what one scan reads."""

    @abstractmethod
    def bounds(self, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """Upper bounds ``[B, H, q, entries]`` on the scores of ``query [B, H, q, D]`` (fp32)."""

    @abstractmethod
    def choose(self, query: torch.Tensor, best: torch.Tensor | None, scaling: float, archive: ArchiveView) -> Choice:
        """The archived rows that some head of a group, for some of ``query [B, H, q, D]``, may need.

        ``best [B, H, q]`` is s* (None when not ``needs_best``). Either a fixed number of candidate
        row indices per (batch, group) (repeats allowed: the runtime keeps each row once) or a
        mask over the archive.
        """

    @abstractmethod
    def select_batch(self, index: torch.Tensor) -> None:
        """Keep batch elements ``index`` of the index (beam reordering: the index must follow the archive)."""

    @abstractmethod
    def repeat_batch(self, repeats: int) -> None:
        """Repeat every batch element of the index ``repeats`` times."""


@dataclass
class Choice:
    """What a retrieval state names for a tile of queries: candidates, or a mask over the archive.

    ``rows``/``ok`` ``[B, G, K]``: candidate archive indices and whether each is chosen (a fixed
    ``K`` per call, e.g. ``j`` per head and query: the decode step stages them without a host
    synchronisation). ``mask [B, G, m]``: when the choice has no small bound (certified mode).
    """

    rows: torch.Tensor | None = None
    ok: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    # which query heads may read each staged row, ``visible(idx [B, G, K]) -> [B, H, K]`` (None: every
    # head of the group reads every row the group fetched)
    visible: Callable[[torch.Tensor], torch.Tensor] | None = None

    def as_mask(self, archived: int) -> torch.Tensor:
        if self.mask is not None:
            return self.mask
        B, G = self.rows.shape[:2]
        mask = torch.zeros(B, G, archived + 1, dtype=torch.bool, device=self.rows.device)
        mask.scatter_(2, torch.where(self.ok, self.rows, archived), True)  # not chosen: a spare column
        return mask[..., :archived]


MULTI_TOKEN_RULES = ("dense", "union")


@dataclass
class Retriever(ABC):
    """Configuration of a retriever; its fields are its hyperparameters.

    ``multi_token`` is the rule for forwards of more than one query (a prefill chunk, a question, a
    teacher-forced answer), the same for every retriever: ``"dense"`` (default, the reference's --
    Quest attends densely whenever a forward has more than one query) reads the whole archive
    beside the attended tier; ``"union"`` scans the index with every query and attends over the
    union of each query's own choice (tiled, bounded memory). Decode steps (one query) always use
    the retriever's own rule.
    """

    multi_token: str = "dense"

    name: ClassVar[str] = ""

    def __post_init__(self) -> None:
        if self.multi_token not in MULTI_TOKEN_RULES:
            raise ValueError(
                f"multi_token must be one of {MULTI_TOKEN_RULES} (how forwards of several queries read the archive), "
                f"got {self.multi_token!r}"
            )

    @abstractmethod
    def new_state(self, geometry: RowGeometry) -> RetrievalState: ...


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


def tier_best(layer: TieredLayer, query: torch.Tensor, q_slots: torch.Tensor, scaling: float) -> torch.Tensor:
    """s* ``[B, H, q]``: each query's best exact score over the rows of the attended tier it may read."""
    keys, slots, valid = layer.tier.get("keys"), layer.tier.get("slots"), layer.tier.get("valid")
    scores = exact_scores(query, keys, scaling)  # [B, H, q, n]
    B, H, q_len, n = scores.shape
    G = keys.shape[1]
    allowed = row_mask(slots, valid, q_slots)[:, :, None].expand(B, G, H // G, q_len, n).reshape(scores.shape)
    return scores.masked_fill(~allowed, float("-inf")).amax(dim=-1)


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


def fetch(
    layer: TieredLayer,
    query: torch.Tensor,
    q_slots: torch.Tensor | None,
    scaling: float,
    best: torch.Tensor | None = None,
    *,
    with_slots: bool = True,
) -> Fetched | None:
    """Scan ``layer``'s index for ``query [B, H, q, D]`` and stage the archived rows it names.

    ``q_slots [q]`` are the queries' slots (None: the forward's last ``q``). ``best [B, H, q]`` is s* when the caller already has it (the decode step computes the tier's
    scores anyway); otherwise it is computed per query tile. Returns None without a retriever or
    an archive. A single query's candidates are staged as they are (a fixed count per (batch,
    group), each row once: no host synchronisation); a multi-token forward's union (:func:`scan`),
    or a choice given as a mask, is compacted to the most rows any (batch, group) needs (one host
    sync). Records the forward's accounting in ``layer.last_step`` and ``layer.policy_info``.
    """
    state = layer.retrieval
    archive = layer.archive
    if state is None or archive.n == 0:
        return None
    q_len = query.shape[2]
    m = archive.n
    view = ArchiveView(archive.get("keys"), archive.get("slots"), archive.get("valid"), layer.budget)

    def best_of(start: int, stop: int) -> torch.Tensor:
        if best is not None:
            return best[:, :, start:stop]
        slots = q_slots if q_slots is not None else torch.arange(layer.seen - q_len, layer.seen, device=query.device)
        return tier_best(layer, query[:, :, start:stop], slots[start:stop], scaling)

    choice = None
    dense = q_len > 1 and layer.cache.retriever.multi_token == "dense"
    if dense:  # the reference's rule for a forward of several queries: read the whole archive
        mask = view.valid.clone()
        idx, picked = torch.arange(m, device=query.device).expand(*mask.shape), mask
    else:
        if q_len == 1:
            choice = state.choose(query, best_of(0, 1) if state.needs_best else None, scaling, view)
        if choice is not None and choice.rows is not None and choice.rows.shape[-1] <= m // 2:
            idx, picked = _unique(choice.rows, choice.ok, m)  # a decode step: stage the candidates as they are
        elif choice is not None:  # a mask, or more candidates than half the archive: a fixed capacity of m
            mask = choice.as_mask(m) & view.valid
            idx, picked = _compact(mask, m if choice.mask is None else int(mask.sum(-1).max()))
        else:
            mask = scan(state, query, best_of, scaling, view)
            idx, picked = _compact(mask, min(m, int(mask.sum(-1).max())))
    names = ("keys", "values") + (("slots",) if with_slots else ()) + (() if layer.all_valid else ("valid",))
    rows = archive.gather(idx, names)  # a decode step needs no slots; an archive without padding no flags
    if "valid" in rows:
        picked = picked & rows["valid"]  # padding rows are never fetched
    head_valid = None
    if choice is not None and choice.visible is not None:
        B, H = query.shape[:2]
        head_valid = choice.visible(idx) & picked.repeat_interleave(H // picked.shape[1], dim=1)
    fetched = Fetched(
        keys=rows["keys"],
        values=rows.get("values"),
        slots=torch.where(picked, rows["slots"], -1) if "slots" in rows else None,
        valid=picked,
        head_valid=head_valid,
        dense=dense,
    )
    _account(layer, query, scaling, state, idx, picked, view, scanned=not dense)
    return fetched


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


def row_bytes(layer: TieredLayer) -> int:
    """Bytes of one row of one (batch, group): its key (latent row on MLA) and its value (GQA)."""
    tier = layer.tier
    per = tier.buffers["keys"].shape[-1] * tier.buffers["keys"].element_size()
    if "values" in tier:
        per += tier.buffers["values"].shape[-1] * tier.buffers["values"].element_size()
    return per


def _account(layer, query, scaling, state, idx, picked, view, *, scanned: bool) -> None:  # noqa: ANN001
    """This forward's KV-path reads: host numbers, plus one device count (the rows fetched)."""
    B, G = picked.shape[:2]
    entries = state.entries() if scanned else 0  # the dense rule reads the archive, not the index
    fetched = picked.sum()  # a device tensor: read only by stats()
    per_row = row_bytes(layer)
    attended = B * G * layer.tier.n * per_row
    index_bytes = B * G * entries * state.entry_bytes
    step: dict[str, Any] = {
        "queries": query.shape[2],
        "rows_scanned": B * G * entries,
        "rows_fetched": fetched,
        "attended_bytes_read": attended,
        "index_bytes_scanned": index_bytes,
        "row_bytes": per_row,
    }
    if layer.cache.audit:
        mask = torch.zeros(B, G, view.keys.shape[2] + 1, dtype=torch.bool, device=picked.device)
        mask.scatter_(2, torch.where(picked, idx, view.keys.shape[2]), True)
        step.update(_audit(query, scaling, state, mask[..., :-1], view))
    layer.last_step = step
    layer.attended_bytes_read += attended
    layer.index_bytes_scanned += index_bytes  # + the fetched rows' bytes, derived by stats()
    info = layer.policy_info
    info["retrieval_steps"] = info.get("retrieval_steps", 0) + 1
    for key in ("rows_scanned", "bound_violations", "recall_hits", "recall_total", "audited_scores"):
        if key in step:
            info[key] = info.get(key, 0) + step[key]
    layer.fetched_rows = layer.fetched_rows + fetched  # one device add per step


def _audit(query, scaling, state, mask, view) -> dict[str, float]:  # noqa: ANN001
    """Exact scores of every archived row, tile by tile: bound violations and recall of the true top rows."""
    B, H, q_len, _ = query.shape
    G, m = view.keys.shape[1], view.keys.shape[2]
    hpg = H // G
    out = {"audited_scores": 0, "bound_violations": 0, "recall_hits": 0, "recall_total": 0}
    size = state.page_size
    for start in range(0, q_len, query_block(B * H, m)):
        q_tile = query[:, :, start : start + query_block(B * H, m)]
        t = q_tile.shape[2]
        exact = exact_scores(q_tile, view.keys, scaling)  # [B,H,t,m]
        ok = view.valid[:, :, None, None, :].expand(B, G, hpg, t, m).reshape(B, H, t, m)
        out["audited_scores"] += int(ok.sum())
        bounds = state.bounds(q_tile, scaling)
        best = exact.masked_fill(~ok, float("-inf"))
        if size > 1:  # per-page bounds: each must cover the best row of its page
            pages = bounds.shape[-1]
            padded = best.new_full((B, H, t, pages * size), float("-inf"))
            padded[..., :m] = best
            best = padded.view(B, H, t, pages, size).amax(-1)
        out["bound_violations"] += int((bounds < best).sum())
        top = min(state.audit_top, m)
        if top:
            true_top = exact.masked_fill(~ok, float("-inf")).topk(top, dim=-1).indices  # [B,H,t,top]
            fetched = mask[:, :, None, None, :].expand(B, G, hpg, t, m).reshape(B, H, t, m)
            out["recall_hits"] += int((fetched.gather(-1, true_top) & ok.gather(-1, true_top)).sum())
            out["recall_total"] += int(ok.gather(-1, true_top).sum())
    if state.audit_top == 0:
        del out["recall_hits"], out["recall_total"]
    return out
