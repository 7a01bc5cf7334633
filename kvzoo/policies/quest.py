"""``quest``: query-aware page selection over an archive that deletes nothing.

Tang et al., "Quest: Query-Aware Sparsity for Efficient Long-Context LLM Inference", ICML 2024,
https://arxiv.org/abs/2406.10774 (reference code: github.com/mit-han-lab/Quest).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from kvzoo.framework.policy import RowsView, SinksAndRecentPolicy, require_int
from kvzoo.retrievers.quest import check_paging


@dataclass
class Quest(SinksAndRecentPolicy):
    """Read the pages whose key bound says they could matter, each decode step; nothing is deleted.

    Quest keeps the whole KV cache in pages of ``page_size`` consecutive tokens, aligned to the sequence start. At each
    decode step every query head scores each page with the upper bound ``sum_i max(q_i min_i, q_i max_i)``
    (element-wise key min/max over the page) and reads its top pages. How many, and whether the current page is
    forced, the reference says two ways, both here by name (``rule``; ``B`` the token budget):

    * ``rule="eval"`` (default) -- its evaluation code (``evaluation/quest_attention.py``, the paper's accuracy
      figures): ``min(max(3, B // page_size), pages)`` pages over *all* pages, the current page competing like any
      other. In kvzoo every row but the sinks is archived after its forward, so the current page is the archive's last
      (partial) page, scored with the step's own key in its min/max as the reference scores it
      (:func:`kvzoo.kernels.choose.quest_choose`'s ``own``); the step's own row is attended apart.
    * ``rule="kernel"`` -- its kernels (``quest/utils/controller.py``, the latency figures): the current page always
      read (it stays attended until it completes) plus the top ``B // page_size - 1`` others; no ``max(3, .)``.

    Both read multi-token forwards (prefill, a question, a teacher-forced answer) densely, as the reference does, and
    the first ``dense_layers`` layers always densely. Known deviations: under ``rule="eval"`` every head reads the
    step's own row; on MLA rows the "key" is the 576-dim latent row and the query the absorbed query; in a left-padded
    batch pages start at each sequence's first real row, and ``rule="kernel"`` (whose pages leave at events the batch
    shares) refuses padding that is not a multiple of ``page_size``; the bound carries a float slack (``kernels/index_scan.py``) so that fp32 rounding never
    undercuts an exact score.

    The ``"quest"`` retriever (``kvzoo/retrievers/quest.py``) takes ``page_size``, ``gqa`` and ``rule`` from here.
    Defaults are Quest's: ``page_size=16``, ``dense_layers=2``, per-head selection (``gqa="head"``: a GQA group
    fetches the union of its heads' pages, each head attends only to its own, the bytes count the union once), no
    sinks. kvzoo's options: ``gqa="group"`` (one page set per KV group by the max over its heads, fewer bytes);
    ``sinks=n`` keeps the first ``n`` rows attended besides the pages.
    """

    sinks: int = 0
    archive: bool | None = True  # Quest deletes nothing (its retriever reads every archived page)
    page_size: int = 16
    dense_layers: int = 2
    gqa: str = "head"
    rule: str = "eval"
    retriever: Any = "quest"

    name: ClassVar[str] = "quest"
    summary: ClassVar[str] = ("each head's top pages by a key min/max bound read per step; rule='eval' (default: the "
                              "reference's evaluation code) or 'kernel' (its kernels)")
    paper: ClassVar[str] = "https://arxiv.org/abs/2406.10774"
    schedule: ClassVar[str] = "step"
    retriever_fields: ClassVar[tuple[str, ...]] = ("page_size", "gqa", "rule")  # retriever="quest" takes them
    press_rule: ClassVar[str] = "kvzoo.integrations.kvpress_presses:quest_priority"  # as a kvpress press: its pages

    def validate(self) -> None:
        super().validate()
        require_int(self.dense_layers, "dense_layers", 0)
        check_paging(self.page_size, self.gqa, self.rule)  # the retriever's checks: one statement of them
        if not self.archive:
            raise ValueError("quest deletes nothing: archive must be True (pages are fetched back from it)")

    def target_rows(self, event, *, budget, resident, block_rows=0, seen=0):
        sinks = min(self.sinks, seen if seen else resident)
        if self.rule == "eval":  # every row but the sinks is archived: the current page competes from the index
            attended = sinks
        else:  # kernel: the current page stays attended; a completed page moves to the archive at once
            current = (seen - sinks) % self.page_size if seen else resident - sinks
            attended = sinks + current
        return attended if resident > attended else None

    def priority(self, rows: RowsView, keep: int):
        """The sinks and the current page (:class:`SinksAndRecentPolicy`). ``rule="kernel"`` in a left-padded batch:
        its pages are the batch's slot multiples and a completed page leaves at an event the batch shares, so a
        sequence whose padding is not a whole number of pages would read other pages than alone -- refused, naming
        what works (checked at events, on the host, only where the layer holds padding)."""
        if self.rule == "kernel" and not rows.all_valid:
            padding = (~rows.valid[:, 0]).sum(-1).tolist()  # left padding per sequence (the rows' first group)
            odd = [(b, p) for b, p in enumerate(padding) if p % self.page_size]
            if odd:
                b, p = odd[0]
                raise ValueError(
                    f"quest(rule='kernel') pages a batch at its shared slots (multiples of page_size={self.page_size}) "
                    f"and archives a page when the batch's slot count completes it: sequence {b}'s left padding of {p} "
                    f"rows is not a multiple of {self.page_size}, so it would read other pages than alone. Give each "
                    f"sequence a left padding that is a multiple of {self.page_size}, decode it alone, or use "
                    "rule='eval' (the default), whose pages start at each sequence's first real token")
        return super().priority(rows, keep)

    @property
    def own_row_archived_next(self) -> bool:  # type: ignore[override]
        """eval: every row but the sinks is archived after its forward, so the step's own row joins the current
        page next (its retriever scores that page with the row's key); kernel: the current page stays attended."""
        return self.rule == "eval"

    @property
    def rows_between_events(self) -> int:  # type: ignore[override]
        """kernel: the current page stays attended until it completes; eval: each forward's rows leave after it."""
        return self.page_size if self.rule == "kernel" else 1
