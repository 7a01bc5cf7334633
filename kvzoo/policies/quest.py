"""``quest``: query-aware page selection over an archive that deletes nothing.

Tang et al., "Quest: Query-Aware Sparsity for Efficient Long-Context LLM Inference", ICML 2024,
https://arxiv.org/abs/2406.10774 (reference code: github.com/mit-han-lab/Quest).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from kvzoo.framework.policy import SinksAndRecentPolicy, require_int
from kvzoo.retrievers.quest import check_paging


@dataclass
class Quest(SinksAndRecentPolicy):
    """Read the pages whose key bound says they could matter, each decode step; nothing is deleted.

    Quest keeps the whole KV cache in pages of ``page_size`` consecutive tokens, aligned to the sequence
    start. At each decode step every query head scores each page with the upper bound
    ``sum_i max(q_i min_i, q_i max_i)`` (element-wise key min/max over the page) and reads its top pages.
    How many, and whether the current page (the one the step's own token is in) is forced, the reference
    says two ways, and both are here by name (``rule``; ``B`` is the token budget, ``floor(context /
    ratio)`` or ``budget``):

    * ``rule="eval"`` (default) -- the reference's evaluation code, ``evaluation/quest_attention.py``
      (``local_heavy_hitter_mask``), which produced the paper's accuracy figures (LongBench, passkey,
      PG19): ``min(max(3, B // page_size), pages)`` pages chosen over *all* pages, the current page among
      them like any other -- read when its bound ranks, not forced. In kvzoo every row but the sinks moves to
      the archive after each forward, so the current page is the archive's last (partial) page and competes
      there; the step's own row is the one row the runtime attends apart (its attended tier).
    * ``rule="kernel"`` -- the reference's kernels and model code (``quest/utils/controller.py``,
      ``quest/models/llama.py``), which produced its latency figures: ``page_budget = B // page_size``, the
      current (last) page always read, and the top ``min(page_budget, pages) - 1`` of the other pages; no
      ``max(3, .)`` (``B < 2 * page_size`` reads the current page only). In kvzoo the attended tier holds
      exactly the current page (when a page completes it moves to the archive whole).

    The default is ``"eval"``: kvzoo's leaderboard measures quality, and the paper's quality figures come
    from the evaluation code; the kernel rule is what its speed figures ran (both rows are on the leaderboard).
    Both read multi-token forwards (the prefill, a question, a teacher-forced answer) densely, as both the
    reference's paths do, and the first ``dense_layers`` layers always densely.

    The current page is scored as the reference scores it, with the step's own key in its min/max (the reference
    writes the new key into its key states before it scores a page): the step's row is indexed only after its
    forward, so the choice joins its key to the open page's running min/max for the scoring
    (:func:`kvzoo.kernels.choose.quest_choose`'s ``own``); at a step that opens a page the 1-row current page is a
    candidate like any other, chosen, it reads no archived row.

    Known deviations: ``rule="eval"`` -- the step's own row is always read by every head (the reference reads
    it only when the current page ranks among a head's pages). On MLA rows the "key" is the
    576-dim latent row and the query the absorbed query (the bound holds for any vectors; the reference has
    no MLA); a padded batch's pages count padding slots; the bound carries a float slack
    (``kernels/index_scan.py``: ``1e-5 * ||q||_1 * max|k|`` per page, so that fp32 rounding never makes it
    undercut an exact score; the reference has none).

    The ``"quest"`` retriever (``kvzoo/retrievers/quest.py``) indexes the archive by page (min/max in the model's
    dtype) and fetches each head's pages (``gqa="head"``: on GQA models the group fetches the union of its heads' pages, each head
    attends only to its own, and the bytes read count the union once); ``retriever="quest"`` takes
    ``page_size``, ``gqa`` and ``rule`` from here. Defaults are Quest's: ``page_size=16``,
    ``dense_layers=2``, per-head selection, no sink kept apart from the pages. kvzoo's options:
    ``gqa="group"`` scores a page per KV group by the max over its heads (one page set for the group, fewer
    bytes); ``sinks=n`` keeps the first ``n`` rows attended besides the pages (then archived pages start
    after them).
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

    @property
    def own_row_archived_next(self) -> bool:  # type: ignore[override]
        """eval: every row but the sinks is archived after its forward, so the step's own row joins the current
        page next (its retriever scores that page with the row's key); kernel: the current page stays attended."""
        return self.rule == "eval"

    @property
    def rows_between_events(self) -> int:  # type: ignore[override]
        """kernel: the current page stays attended until it completes; eval: each forward's rows leave after it."""
        return self.page_size if self.rule == "kernel" else 1
