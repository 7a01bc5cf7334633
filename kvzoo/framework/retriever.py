"""The retriever interface (policy layer): an index over a layer's archive, tensors in, rows out.

A *retriever* is a configuration (a dataclass of its hyperparameters) that makes one *state* per layer; the state
indexes rows as they are archived (:meth:`RetrievalState.index`) and answers :meth:`RetrievalState.choose`: which
archived rows these queries need. The retrieval tier (``framework/retrieval.py``) fetches them, attends and
accounts. Retrievers reach kvzoo by name through the registry, as policies do. Importable with torch alone.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

# How a forward of several queries (a prefill chunk, a question, a teacher-forced answer) reads the
# archive, the same for every retriever (Retriever.multi_token).
MULTI_TOKEN_RULES = ("dense", "union")


@dataclass
class RowGeometry:
    """What a retrieval state needs to know about the rows it indexes."""

    layout: str  # "gqa" or "mla"
    content_dim: int  # MLA: the latent c's width (512); GQA: 0 (the whole key is content)
    branch_dim: int = 0  # MLA: the decoupled branch r's width (64); GQA: 0
    # TieredCache(..., capacity=N): the most rows a layer sees; an index then preallocates for them and a decode
    # step scans its whole buffer with the live count on the device (None: it grows as rows arrive)
    capacity: int | None = None


class ArchiveView:
    """One layer's archive as tensors (what a retriever may read at scan time).

    ``keys [B, G, m, D]`` (MLA: latent rows), ``slots [B, G, m]``, ``valid [B, G, m]``, in archive order (given, or
    gathered through ``read(name)`` when first read), ``budget`` (the layer's, in rows); ``rows`` (``m``) and
    ``groups`` (``G``) are known without reading. A decode step's view also carries ``positions [B, G, m]`` (each
    row's storage position, -1 past the live ones), ``fetched`` (the layer's fetched-rows count, which a fused choice
    may add to in place) and, where the policy archives the step's own row next, ``own_row``: ``(keys [B, G, N, D],
    valid [B, G, N], position [B, G])`` (Quest's eval rule scores the current page with it). ``padded``: whether some
    archived row may be padding (a layer's view says so from its storage; False, the default: every row is a real
    one, and an index reads no row flags and keeps its pages aligned at row 0).
    """

    def __init__(self, keys: torch.Tensor | None = None, slots: torch.Tensor | None = None,
                 valid: torch.Tensor | None = None, budget: int | None = None, *,
                 read: Callable[[str], torch.Tensor] | None = None, rows: int | None = None,
                 groups: int | None = None, positions: torch.Tensor | None = None,
                 fetched: torch.Tensor | None = None,
                 own_row: Callable[[], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None,
                 padded: bool = False) -> None:
        self._given = {"keys": keys, "slots": slots, "valid": valid}
        self._read = read
        self._own_row = own_row
        self.budget = budget
        self.positions = positions
        self.fetched = fetched
        self.padded = padded
        self.rows = rows if rows is not None else (keys.shape[2] if keys is not None else None)
        self.groups = groups if groups is not None else (keys.shape[1] if keys is not None else None)

    def _get(self, name: str) -> torch.Tensor:
        given = self._given[name]
        if given is None:
            given = self._given[name] = self._read(name)
        return given

    @property
    def keys(self) -> torch.Tensor:
        return self._get("keys")

    @property
    def own_row(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """A decode step's own row (class docstring), None when the view has none."""
        return self._own_row() if self._own_row is not None else None

    @property
    def slots(self) -> torch.Tensor:
        return self._get("slots")

    @property
    def valid(self) -> torch.Tensor:
        return self._get("valid")


@dataclass
class Choice:
    """The archived rows a retrieval state names for some queries.

    ``rows``/``ok`` ``[B, G, K]``: archive-list indices and whether each is fetched, a fixed ``K`` per call (a decode
    step reads them without a host synchronisation). In a decode step's choice each fetched row is flagged once per
    group, or, with ``head_valid``, once per head segment; a multi-token choice may repeat rows (only its mask is
    read). ``rows`` None: ``ok [B, G, m]`` is a mask over the whole archive list (the certified rule).
    """

    rows: torch.Tensor | None
    ok: torch.Tensor
    # ``[B, H, K]``: which query heads read each row (Quest's own pages per head: head h reads its own segment of
    # its group's rows); None: every head of the group reads every row the group fetched
    head_valid: torch.Tensor | None = None
    # the rows' storage positions ``[B, G, K]`` when the choice's op returned them (else read from the archive list)
    positions: torch.Tensor | None = None
    # the rows the groups read at least once (int64 0-dim, on the device); None: ``ok.sum()``
    count: torch.Tensor | None = None
    # ``count`` was already added to the layer's count (``ArchiveView.fetched``) by the choice's own op
    counted: bool = False
    # the index bytes the choice read (int64 0-dim, on the device), where that depends on the data (a pruned scan);
    # None: the index's ``scan_cost``
    index_bytes: torch.Tensor | None = None

    def as_mask(self, archived: int) -> torch.Tensor:
        """The choice as bool ``[B, G, archived]`` over the archive list."""
        if self.rows is None:
            return self.ok
        B, G = self.rows.shape[:2]
        mask = torch.zeros(B, G, archived + 1, dtype=torch.bool, device=self.rows.device)
        mask.scatter_(2, torch.where(self.ok, self.rows, archived), True)  # not chosen: a spare column
        return mask[..., :archived]


class RetrievalState(ABC):
    """One layer's index over its archive."""

    page_size: int = 1  # archived rows one entry covers (Quest's pages; 1 for per-row indexes)
    # pages from each sequence's first real row: virtual rows before each archive, [B, G] (None: pages at row 0)
    page_shift: torch.Tensor | None = None
    needs_best: bool = True  # choose() reads s*, the attended tier's best score per head and query
    audit_top: int = 0  # how many true top rows the audit's recall looks at

    @abstractmethod
    def index(self, rows: dict[str, torch.Tensor], tier: ArchiveView, archive: ArchiveView | None) -> None:
        """Index ``rows`` (``keys [B, G, k, D]``, ``valid``, ...) as they join the end of ``archive``.

        ``tier`` is the attended tier before the eviction (the closing block; a basis may be fitted to it);
        ``archive`` is the archive before ``rows`` join it (to rebuild an index).
        """

    def index_in_place(self, storage: dict[str, torch.Tensor], positions: torch.Tensor) -> bool:
        """Index the rows at ``positions [B, G, k]`` of the layer's storage (``keys``, ``valid``: whole) where they lie,
        if this index can (True; e.g. one row a step, in one op); False (the default): the layer gathers them and
        calls :meth:`index`."""
        return False

    def audit_step(self, query: torch.Tensor, best: torch.Tensor, scaling: float, exact: torch.Tensor,
                   valid: torch.Tensor) -> dict[str, int]:
        """An audited decode step's figures of the index's own (``exact [B, H, 1, m]``: every archived row's exact
        score, ``valid [B, G, m]``, ``best [B, H, 1]``: s*), added to the layer's counters: none by default."""
        return {}

    @abstractmethod
    def scan_cost(self, query_rows: int) -> tuple[int, int]:
        """What one scan reads per (batch, group) for ``query_rows`` query rows (a group's heads x queries): index
        entries, and index bytes."""

    @abstractmethod
    def bounds(self, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """Upper bounds ``[B, H, q, entries]`` on the scores of ``query [B, H, q, D]`` (fp32)."""

    @abstractmethod
    def choose(self, query: torch.Tensor, best: torch.Tensor | None, scaling: float, archive: ArchiveView) -> Choice:
        """The archived rows that some head of a group, for some of ``query [B, H, q, D]``, may need
        (``best [B, H, q]``: s*, None when not ``needs_best``)."""

    @abstractmethod
    def select_batch(self, index: torch.Tensor) -> None:
        """Keep batch elements ``index`` of the index (beam reordering: the index must follow the archive)."""

    @abstractmethod
    def repeat_batch(self, repeats: int) -> None:
        """Repeat every batch element of the index ``repeats`` times."""


@dataclass
class Retriever(ABC):
    """Configuration of a retriever; its fields are its hyperparameters.

    ``multi_token``: how a forward of several queries reads the archive -- ``"dense"`` (default; Quest's reference
    attends densely then) the whole archive beside the tier, ``"union"`` the union of each query's own choice
    (tiled). Decode steps always use the retriever's own rule.
    """

    multi_token: str = "dense"

    name: ClassVar[str] = ""
    # configurations worth comparing with the default, as parameters of a policy holding this retriever by name
    # (it takes them through its fields: ``Policy.retriever_fields``); the leaderboard runs each beside the policy
    variants: ClassVar[tuple[str, ...]] = ()

    def __post_init__(self) -> None:
        if self.multi_token not in MULTI_TOKEN_RULES:
            raise ValueError(
                f"multi_token must be one of {MULTI_TOKEN_RULES} (how forwards of several queries read the archive), "
                f"got {self.multi_token!r}"
            )

    def config(self) -> dict[str, Any]:
        """The full configuration: name plus every field (what results files record)."""
        return {"name": self.name, **dataclasses.asdict(self)}

    @abstractmethod
    def new_state(self, geometry: RowGeometry) -> RetrievalState: ...
