"""The retrieval tier: an index over each layer's archive that brings rows back for one step.

A *retriever* (configuration, a dataclass) makes one *state* per layer. The state indexes rows as
they are archived (``index``) and, at every forward, names the archived rows the queries could
need (``choose``). :func:`retrieve` -- called by the attention path -- gathers those rows from the
archive, bit-exact, so that they join this step's softmax alongside the attended tier, and keeps
the accounting: rows scanned, rows fetched, KV-path bytes read (attended rows + index entries
scanned + fetched rows), and, with ``TieredCache(..., audit=True)``, bound violations and the
recall of the true top rows.

Retrievers are named: ``"vestige"`` (certified sketch, ``policies/vestige.py``) and ``"quest"``
(page min/max, ``policies/quest.py``). Any selector combines with any retriever:
``registry.get("snapkv", retriever="vestige")``.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from kvzoo.kernels.attention import row_mask
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
class Choice:
    """Archived rows to fetch for one forward: ``mask [B, G, m]`` over the joined archive."""

    mask: torch.Tensor
    bounds: torch.Tensor | None = None  # [B, H, q, m] per-row upper bounds (for audits)
    entries_scanned: int = 0  # index entries read per (batch, group)
    entry_bytes: int = 0  # bytes of one index entry
    audit_top: int = 0  # how many true top rows the audit's recall looks at
    page_size: int = 0  # > 0 when ``bounds`` are per page of this many consecutive archived rows


class RetrievalState(ABC):
    """One layer's index over its archive."""

    @abstractmethod
    def index(self, layer: TieredLayer, rows: dict[str, torch.Tensor], block_keys: torch.Tensor) -> None:
        """Index ``rows`` (``keys [B,G,k,D]``, ...) that are about to join the archive.

        ``block_keys`` is the attended tier before the eviction (the whole closing block).
        """

    @abstractmethod
    def choose(
        self, layer: TieredLayer, query: torch.Tensor, q_slots: torch.Tensor, scaling: float, best_attended
    ) -> Choice:
        """Which archived rows this forward's ``query [B,H,q,D]`` may need.

        ``best_attended()`` returns s*, the best exact score over the attended tier ``[B,H,q]``
        (computed on demand: Quest does not need it).
        """


@dataclass
class Retriever(ABC):
    """Configuration of a retriever; its fields are its hyperparameters."""

    name: ClassVar[str] = ""

    @abstractmethod
    def new_state(self, layer: TieredLayer) -> RetrievalState: ...


def _row_bytes(layer: TieredLayer) -> int:
    per = layer.keys.shape[-1] * layer.keys.element_size()
    if layer.values is not None:
        per += layer.values.shape[-1] * layer.values.element_size()
    return per


def retrieve(
    layer: TieredLayer, query: torch.Tensor, q_slots: torch.Tensor, scaling: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows for this forward's attention: the attended tier plus the archived rows fetched back.

    Returns ``keys, values, slots, valid`` with the fetched rows appended after the tier (padded
    with invalid rows where batch elements or groups fetch different counts).
    """
    keys, values, slots, valid = layer.keys, layer.value_rows(), layer.slots, layer.valid
    state = layer.retrieval
    archive = layer.archive.tensors()
    B, G = keys.shape[:2]
    attended_bytes = B * G * layer.num_rows * _row_bytes(layer)
    if state is None or not archive:
        layer.last_step = {"attended_bytes_read": attended_bytes, "kv_bytes_read": attended_bytes}
        return keys, values, slots, valid

    def best_attended() -> torch.Tensor:
        scores = exact_scores(query, keys, scaling)  # [B,H,q,n]
        allowed = row_mask(slots, valid, q_slots)  # [B,G,q,n]
        H = query.shape[1]
        allowed = allowed[:, :, None].expand(B, G, H // G, *allowed.shape[2:]).reshape(scores.shape)
        return scores.masked_fill(~allowed, float("-inf")).amax(dim=-1)

    choice = state.choose(layer, query, q_slots, scaling, best_attended)
    mask = choice.mask & archive["valid"]  # padding rows are never fetched
    counts = mask.sum(-1)  # [B, G]
    f = int(counts.max())
    # fetched rows first (in archive order), then the rest; keep the first f per (batch, group)
    order = torch.sort((~mask).to(torch.uint8), dim=-1, stable=True).indices[..., :f]
    picked = torch.arange(f, device=mask.device).expand(B, G, f) < counts[..., None]

    def take(t: torch.Tensor) -> torch.Tensor:
        if t.dim() == 4:
            return t.gather(2, order[..., None].expand(B, G, f, t.shape[-1]))
        return t.gather(2, order)

    arch_keys = archive["keys"]
    f_keys = take(arch_keys)
    f_values = take(archive["values"]) if "values" in archive else f_keys[..., : values.shape[-1]]
    f_slots = torch.where(picked, take(archive["slots"]), torch.full_like(order, -1))
    f_valid = picked & take(archive["valid"])

    fetched = int(counts.sum())
    q_len = query.shape[2]
    step = {
        "queries": q_len,
        "rows_scanned": B * G * choice.entries_scanned,
        "rows_fetched": fetched,
        "rows_fetched_per_query": fetched / q_len,
        "attended_bytes_read": attended_bytes,
        "index_bytes_scanned": B * G * choice.entries_scanned * choice.entry_bytes,
        "fetched_bytes": fetched * _row_bytes(layer),
    }
    step["kv_bytes_read"] = step["attended_bytes_read"] + step["index_bytes_scanned"] + step["fetched_bytes"]
    if layer.cache.audit:
        step.update(_audit(layer, query, scaling, mask, choice, arch_keys, archive["valid"]))
    layer.last_step = step
    info = layer.policy_info
    info["retrieval_steps"] = info.get("retrieval_steps", 0) + 1
    for key in ("rows_scanned", "rows_fetched", "index_bytes_scanned", "fetched_bytes", "attended_bytes_read",
                "kv_bytes_read", "bound_violations", "recall_hits", "recall_total", "audited_scores"):
        if key in step:
            info[key] = info.get(key, 0) + step[key]
    layer.fetched_rows += fetched
    return (
        torch.cat([keys, f_keys], dim=2),
        torch.cat([values, f_values], dim=2),
        torch.cat([slots, f_slots], dim=2),
        torch.cat([valid, f_valid], dim=2),
    )


def _audit(layer, query, scaling, mask, choice, arch_keys, arch_valid) -> dict[str, float]:  # noqa: ANN001
    """Exact scores of every archived row: bound violations and recall of the true top rows."""
    exact = exact_scores(query, arch_keys, scaling)  # [B,H,q,m]
    B, H, q_len, m = exact.shape
    G = arch_keys.shape[1]
    ok = arch_valid[:, :, None, None, :].expand(B, G, H // G, q_len, m).reshape(B, H, q_len, m)
    out: dict[str, float] = {"audited_scores": int(ok.sum())}
    if choice.bounds is not None:
        if not choice.page_size:  # per-row bounds
            out["bound_violations"] = int(((choice.bounds < exact) & ok).sum())
        else:  # per-page bounds: each must cover the best row of its page
            pages, size = choice.bounds.shape[-1], choice.page_size
            padded = torch.full((B, H, q_len, pages * size), float("-inf"))
            padded[..., :m] = exact.masked_fill(~ok, float("-inf"))
            best = padded.view(B, H, q_len, pages, size).amax(-1)
            out["bound_violations"] = int((choice.bounds < best).sum())
    top = min(choice.audit_top, m)
    if top:
        true_top = exact.masked_fill(~ok, float("-inf")).topk(top, dim=-1).indices  # [B,H,q,top]
        fetched = mask[:, :, None, None, :].expand(B, G, H // G, q_len, m).reshape(B, H, q_len, m)
        hits = fetched.gather(-1, true_top) & ok.gather(-1, true_top)
        out["recall_hits"] = int(hits.sum())
        out["recall_total"] = int(ok.gather(-1, true_top).sum())
    return out
