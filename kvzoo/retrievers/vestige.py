"""VestigeKV's retriever (the registry's ``"vestige"``): its settings, and the index kind each layout takes (the
kinds live beside it; what they share is in ``int8.py``; the policy is ``kvzoo/policies/vestige.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvzoo.framework.policy import require_int
from kvzoo.framework.retriever import Retriever, RowGeometry
from kvzoo.retrievers.int8 import EntryIndex, Int8KeyIndex
from kvzoo.retrievers.paged import PagedKeyIndex
from kvzoo.retrievers.sketch import SketchIndex

RANK_BY = ("estimate", "bound")
INDEX_KINDS = ("auto", "sketch", "int8", "paged")
INDEX_KINDS_BY_NAME: dict[str, type[EntryIndex]] = {"sketch": SketchIndex, "int8": Int8KeyIndex,
                                                    "paged": PagedKeyIndex}
ENTRY_DTYPES = {"float32": torch.float32, "float16": torch.float16}


@dataclass
class VestigeRetriever(Retriever):
    """VestigeKV's recall index over archived rows (paper §4.2; docs/fidelity.md): per-row bounds on each row's
    score, and the rows that could matter fetched back each step, as the union over a group's query heads and queries.

    Top-j mode (default): each head ranks the rows by the bound's *estimate* (the bound less its Cauchy-Schwarz term
    and slack; ``rank_by="bound"`` ranks by the bound) and fetches its top ``j`` whose bound is above ``s* - j_margin``
    (s*: the query's best exact score over the attended tier). On SmolLM2 the estimate of int8 keys found 97 % of the
    exact top-16 archived rows per head, the bound's ranking 24 % (CHANGELOG.md). ``certified=True`` fetches every row
    with bound >= s* - ``tau``: the softmax mass left out is at most ``(T - |F|) e^-tau`` of the attended tier's
    (Lemma 3). ``index`` picks the kind (``"auto"``: int8 on GQA rows, the sketch on MLA rows): ``"sketch"``
    (``sketch.py``), ``"int8"`` (``int8.py``) or ``"paged"`` (``paged.py``: a fifth of int8's bytes, half its recall on
    SmolLM2 -- an option for the bytes, not the default). ``prune=True`` (int8, top-j by estimate): page summaries
    scanned first, and the entries of a page certified below ``s* - j_margin`` for every head of its group not read
    (``int8.py``); off by default: on SmolLM2 its min/max bound skipped under 1 % of the pages and the summaries cost
    more bytes than that saves (docs/fidelity.md).
    """

    rank: int | None = None  # None: 64 on MLA rows, head_dim // 4 on GQA rows
    j: int = 16
    certified: bool = False
    tau: float = 8.0
    refit: bool = False
    rank_by: str = "estimate"  # top-j mode: rank rows by the bound's estimate (its in-span part) or by the bound
    entry_dtype: str = "float32"  # sketch entries: "float16" halves their bytes (the slack widened: still certified)
    index: str = "auto"  # "sketch" (the low-rank sketch), "int8" (per-row int8 keys, GQA only); auto: int8 on GQA
    j_margin: float = 8.0  # top-j mode keeps a candidate whose bound > s* - j_margin (0: beats s*, the earlier rule)
    page_rows: int = 16  # index="paged" (or "int8" with prune=True): archived rows one page summary covers
    fine_pages: int = 4  # index="paged": pages per query head whose rows' int8 entries a step scans
    # index="int8": scan page summaries first and skip the int8 entries of pages certified below s* - j_margin for
    # every head of the group (off: on SmolLM2 the min/max bound skipped no page; docs/fidelity.md)
    prune: bool = False

    name: ClassVar[str] = "vestige"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.rank is not None:
            require_int(self.rank, "rank", 1, "sketch rank; None picks 64 on MLA rows, head_dim // 4 on GQA")
        require_int(self.j, "j", 1, "rows fetched per step and head")
        if isinstance(self.tau, bool) or not isinstance(self.tau, (int, float)) or not math.isfinite(self.tau) \
                or self.tau < 0:
            raise ValueError(f"tau must be a finite number >= 0 (the certified margin, in logits), got {self.tau!r}")
        if self.rank_by not in RANK_BY:
            raise ValueError(f"rank_by must be one of {RANK_BY} (how top-j mode ranks rows), got {self.rank_by!r}")
        if isinstance(self.j_margin, bool) or not isinstance(self.j_margin, (int, float)) \
                or not math.isfinite(self.j_margin) or self.j_margin < 0:
            raise ValueError(f"j_margin must be a finite number >= 0 (logits below s*), got {self.j_margin!r}")
        if self.index not in INDEX_KINDS:
            raise ValueError(f"index must be one of {INDEX_KINDS} (what an index entry holds), got {self.index!r}")
        if self.entry_dtype not in ENTRY_DTYPES:
            raise ValueError(f"entry_dtype must be one of {tuple(ENTRY_DTYPES)}, got {self.entry_dtype!r}")
        require_int(self.page_rows, "page_rows", 1, "archived rows per page summary (index='paged')")
        require_int(self.fine_pages, "fine_pages", 1, "pages per query head scanned row by row (index='paged')")
        if not isinstance(self.certified, bool) or not isinstance(self.refit, bool) or not isinstance(self.prune, bool):
            raise ValueError(f"certified, refit and prune must be True or False, got {self.certified!r}, "
                             f"{self.refit!r}, {self.prune!r}")
        if self.prune and (self.certified or self.rank_by != "estimate"):
            raise ValueError("prune=True has no effect with certified=True or rank_by='bound': it prunes the decode "
                             "step's top-j rule by estimate (the default); leave prune=False there")
        if self.index != "auto":
            self._refuse_idle_options(self.index)
        if not self.certified and self.tau != VestigeRetriever.tau:
            raise ValueError(f"tau={self.tau!r} has no effect: it is the certified mode's margin (certified=True); "
                             "the default top-j mode keeps rows by j and j_margin")

    # the options each index kind reads (the others would be accepted and recorded while doing nothing)
    OPTIONS_OF: ClassVar[dict[str, tuple[str, ...]]] = {
        "sketch": ("rank", "entry_dtype", "refit"), "int8": ("prune", "page_rows"), "paged": ("page_rows", "fine_pages")}

    def _refuse_idle_options(self, kind: str, where: str = "") -> None:
        """ValueError naming an option set away from its default that the index kind ``kind`` does not read."""
        for option, default in (("rank", None), ("entry_dtype", "float32"), ("refit", False), ("page_rows", 16),
                                ("fine_pages", 4), ("prune", False)):
            if getattr(self, option) != default and option not in self.OPTIONS_OF[kind]:
                users = [k for k, options in self.OPTIONS_OF.items() if option in options]
                raise ValueError(
                    f"vestige retriever: {option}={getattr(self, option)!r} has no effect with index={kind!r}{where}: "
                    f"it applies to index={' or '.join(map(repr, users))} only; leave it at its default "
                    f"({default!r}) or choose that index")
        if kind == "int8" and not self.prune and self.page_rows != 16:
            raise ValueError(f"vestige retriever: page_rows={self.page_rows!r} has no effect with index='int8'{where} "
                             "and prune=False: the int8 index reads it for its page summary (prune=True) only")

    def kind(self, layout: str) -> str:
        """The index kind on rows of ``layout``: ``index``, with ``"auto"`` resolved (MLA: sketch, GQA: int8)."""
        if self.index == "auto":
            return "sketch" if layout == "mla" else "int8"
        return self.index

    def new_state(self, geometry: RowGeometry) -> EntryIndex:
        kind = self.kind(geometry.layout)
        if kind in ("int8", "paged") and geometry.layout == "mla":
            raise ValueError(f"vestige retriever: index={kind!r} is for GQA rows (an MLA latent row is 576 values: "
                             "use the sketch)")
        if self.index == "auto":  # the kind follows the rows: their options are known only now
            self._refuse_idle_options(kind, f" (index='auto' on {geometry.layout.upper()} rows)")
        return INDEX_KINDS_BY_NAME[kind](self, geometry)
