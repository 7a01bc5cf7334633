"""The policy interface: a selector, an optional retriever, and a schedule (the policy layer).

A *policy* decides which cache rows live in the attended tier; the runtime (``framework/runtime.py``) fires the
schedule, fixes the budget, calls the selector, moves rows and indexes them. Everything a policy sees arrives as
tensors in a :class:`RowsView`, so a selector runs in kvzoo's runtime or in kvpress's pipeline without a cache
object. This module imports torch alone. The vocabulary (row, slot, tier, archive), the events and the class
attributes the framework reads are in docs/architecture.md and docs/extending.md ("The policy surface").
"""

from __future__ import annotations

import dataclasses
import math
import warnings
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, ClassVar, Literal, NoReturn

import torch
import torch.nn.functional as F

from kvzoo.framework.plugins import plugin_failed, plugin_label
from kvzoo.framework.retriever import Retriever
from kvzoo.kernels.attention import window_attention

Event = Literal["context_end", "step", "block"]
# when a policy's selector fires besides the context's end (Policy.schedule): never, after every forward, or when a
# block of rows has arrived since the last event
SCHEDULES: tuple[str, ...] = ("context_end", "step", "block")
LAYOUTS: tuple[str, ...] = ("gqa", "mla")


class Observation(str, Enum):
    """What a policy may ask the runtime to record for it (``Policy.observes``); a member equals its string."""

    WINDOW = "window"  # RowsView.observed_window(): the last `observation_window` queries' attention over the rows
    ACCUMULATE = "accumulate"  # row_stats["attention"]: the attention each row received, every query of every
    # forward summed, over the query heads of its group too
    INPUTS = "inputs"  # RowsView.inputs: the attention module and its input hidden states (GQA models)

    def __str__(self) -> str:  # messages name an observation as a policy writes it: accumulate, ['accumulate']
        return self.value

    def __repr__(self) -> str:
        return repr(self.value)


def observations(observes: Iterable[Any], who: str = "a policy") -> frozenset[Observation]:
    """``observes`` as :class:`Observation` members; ValueError naming the valid ones for anything else."""
    valid = [o.value for o in Observation]
    if isinstance(observes, (str, bytes)) or not isinstance(observes, Iterable):
        raise ValueError(f"{who}: observes must be a frozenset of observations (frozenset({{Observation.WINDOW}})), "
                         f"got {observes!r}; valid observations: {', '.join(valid)}")
    out = set()
    for what in observes:
        try:
            out.add(Observation(what))
        except ValueError:
            raise ValueError(f"{who} observes {what!r}, which the runtime does not record; valid observations: "
                             f"{', '.join(valid)} (kvzoo.framework.policy.Observation)") from None
    return frozenset(out)


@dataclass
class Counters:
    """Numbers a policy counts for one layer (int or float fields, zero by default): subclass it, and hand one to
    :meth:`RowsView.count`; ``cache.stats()`` reports them in ``policy_info``, and the results rows carry them."""

    def as_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)


@dataclass
class AttentionInputs:
    """What an attention layer was given for some rows (the ``inputs`` observation)."""

    module: Any  # the attention module (torch.nn.Module)
    hidden_states: torch.Tensor  # [B, n, d], its input
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None  # RoPE (cos, sin), [B, n, dh] each


@dataclass
class WindowQueries:
    """The observation window's source: the latest ``size`` queries of a layer, the last at slot ``end - 1``;
    ``queries()`` gives them ``[B, H, size, D]``, called only when a selector reads the window."""

    size: int
    end: int
    scaling: float
    queries: Callable[[], torch.Tensor]


@dataclass
class RowsView:
    """What a selector may read about one layer's attended tier, as plain tensors.

    Shapes: ``B`` batch, ``G`` KV groups (KV heads on GQA, 1 on MLA), ``N`` rows in the attended
    tier, ``D`` key (or latent row) width, ``H`` query heads, ``w`` observation-window queries.

    ``keys``, ``values``, ``slots`` and ``valid`` may be given as tensors or, by the runtime, read on first use
    through ``read(name)`` (a selector that reads only the slots -- a per-step victim -- never gathers a key).
    """

    keys: torch.Tensor  # [B, G, N, D] rotated keys (GQA) or latent rows [c ; r] (MLA)
    values: torch.Tensor | None  # [B, G, N, Dv]; on MLA rows the content latent c, keys[..., :D - branch_dim]
    slots: torch.Tensor  # [B, G, N] int64, the row's index in the sequence (padding counted)
    valid: torch.Tensor  # [B, G, N] bool, False for padding rows
    layer_idx: int  # the model's layer index
    num_layers: int  # layers kvzoo compresses (Kimi Linear: its MLA layers only, not the KDA ones)
    layout: str = "gqa"  # "gqa" or "mla"
    layer_rank: int = 0  # this layer's index among those num_layers (== layer_idx when all layers attend)
    branch_dim: int = 0  # MLA: width of the decoupled branch r at the end of each row (64); GQA: 0
    first_new: int = 0  # rows [first_new:] arrived since this layer's previous event
    # no row of this layer is padding (known on the host): a rule may skip its padding masks (a decode step's
    # victim costs fewer ops); False when some may be
    all_valid: bool = False
    # observation window: the last w queries of the layer attending to the rows, softmax in fp32,
    # causal (a query never sees a row from its future). None unless the policy asked for it.
    # Read it with observed_window(): the runtime computes it only when a selector asks.
    window_attention: torch.Tensor | None = None  # [B, H, w, N]
    window_fn: Callable[[], torch.Tensor] | None = field(default=None, repr=False)
    # w, the observation window's query count, known without computing its attention (0: not given; then
    # window_size() computes the attention to learn it). What a check of lengths alone reads.
    window_queries: int = 0
    # per-row statistics the policy keeps (e.g. H2O's accumulated attention), [B, G, N] each;
    # the runtime gathers them along with the rows, so they follow rows when rows move.
    row_stats: dict[str, torch.Tensor] = field(default_factory=dict)
    # cross-layer scratch of this policy on this cache (ChunkKV's index reuse); plain dict.
    shared: dict[str, Any] = field(default_factory=dict)
    # the layer's counters, the policy's and the retriever's, by name: what cache.stats() reports in policy_info.
    # A policy adds its own with count(Counters)
    info: dict[str, float] = field(default_factory=dict)
    # what the attention layer was given for the rows since the layer's last event (AttentionInputs), for a policy
    # that runs the model's own code on it (a kvpress press: kvzoo.integrations.kvpress). None unless the policy
    # observes "inputs" (recorded on GQA models, until the context ends) or a kvpress press hands them over.
    inputs: AttentionInputs | None = None
    # the runtime's reader of the tensor fields left None (``read("keys")``): they are taken when first used
    read: Callable[[str], torch.Tensor | None] | None = field(default=None, repr=False, compare=False)

    @property
    def num_rows(self) -> int:
        return self.slots.shape[2]

    def count(self, counters: Counters) -> None:
        """Add ``counters`` to the layer's (``info``)."""
        for name, value in counters.as_dict().items():
            self.info[name] = self.info.get(name, 0) + value

    def observed_window(self) -> torch.Tensor | None:
        """The observation-window attention ``[B, H, w, N]`` (computed on first use, then kept)."""
        if self.window_attention is None and self.window_fn is not None:
            self.window_attention = self.window_fn()
        return self.window_attention

    def window_size(self) -> int:
        """``w``, the observation window's query count (0: none recorded), from lengths alone when the runtime gave
        it (``window_queries``): the window attention is then not computed."""
        if self.window_attention is not None:
            return self.window_attention.shape[2]
        if self.window_queries:
            return self.window_queries
        window = self.observed_window()
        return 0 if window is None else window.shape[2]

    def sinks(self, n: int) -> torch.Tensor:
        """Bool ``[B, G, N]``: each sequence's ``n`` earliest valid rows (by slot: the rows may be in any order;
        padding is never a sink)."""
        return _valid_by_slot(self.slots, self.valid, n, self.all_valid, latest=False)

    def recent(self, n: int) -> torch.Tensor:
        """Bool ``[B, G, N]``: each sequence's ``n`` latest valid rows (by slot: the rows may be in any order;
        padding is never recent)."""
        return _valid_by_slot(self.slots, self.valid, n, self.all_valid, latest=True)


def _read_on_first_use(name: str) -> property:
    """A :class:`RowsView` tensor field that, left None, is read through the view's ``read`` when first used."""
    private = "_" + name

    def get(self: RowsView) -> torch.Tensor | None:
        value = self.__dict__.get(private)
        if value is None and self.__dict__.get("read") is not None:
            value = self.__dict__[private] = self.read(name)
        return value

    def set(self: RowsView, value: torch.Tensor | None) -> None:
        self.__dict__[private] = value

    return property(get, set)


for _name in ("keys", "slots", "valid"):
    setattr(RowsView, _name, _read_on_first_use(_name))


def _values(self: RowsView) -> torch.Tensor | None:
    """The rows' values ``[B, G, N, Dv]``; on MLA rows, where the latent row is both key and value, its content
    latent ``c`` (``keys[..., :D - branch_dim]``, a view: what the decode attention reads as values)."""
    value = _read_values.fget(self)
    if value is None and self.layout == "mla" and self.keys is not None:
        value = self.keys[..., : self.keys.shape[-1] - self.branch_dim]
    return value


_read_values = _read_on_first_use("values")
RowsView.values = property(_values, _read_values.fset)


def observed_rows(policy: Policy, keys: torch.Tensor | None, values: torch.Tensor | None, slots: torch.Tensor | None,
                  valid: torch.Tensor | None, *, window: WindowQueries | None = None, **where: Any) -> RowsView:
    """The one builder of a :class:`RowsView` (kvzoo's runtime and the kvpress bridge): the rows, what ``policy``
    observes of them, and ``where`` (the other :class:`RowsView` fields). The window attention -- the ``window``
    queries' fp32 softmax over the rows, causal by slot -- is wired only for a policy observing the window, and
    computed on first read."""
    window_fn = None
    ref: Callable[[], RowsView | None] = lambda: None  # noqa: E731
    if window is not None and window.size > 0 and Observation.WINDOW in policy.observes:
        def window_fn() -> torch.Tensor:  # [B, H, w, N]
            view = ref()
            q_slots = torch.arange(window.end - window.size, window.end, device=view.slots.device)
            return window_attention(window.queries(), q_slots, view.keys, view.slots, view.valid, window.scaling)

    view = RowsView(keys=keys, values=values, slots=slots, valid=valid, window_fn=window_fn,
                    window_queries=window.size if window_fn is not None else 0, **where)
    # the view reaches its window attention through a weak reference: a strong one is a cycle (view -> window_fn ->
    # view) that only the garbage collector frees, holding every layer's window attention and rows meanwhile
    ref = weakref.ref(view)
    return view


@dataclass
class Policy(ABC):
    """Base class of every kvzoo policy: a dataclass whose fields are its hyperparameters.

    Subclasses set the class attributes below and write one method, :meth:`priority` (a score per row, as a
    kvpress ``ScorerPress`` writes ``score()``); :meth:`select` and :meth:`step_victim` derive from it.
    """

    ratio: float | None = None  # keep floor(rows / ratio) rows; exactly one of ratio / budget (full: neither)
    budget: int | None = None  # rows kept per layer and KV group
    # True: evicted rows stay, bit-exact, in the archive; False: dropped and counted; None: an archive exactly when a
    # retriever reads it (resolved to True or False at construction)
    archive: bool | None = None
    retriever: Any = None  # a registered retriever name (resolved by the registry), a Retriever object, or None

    # --- class attributes a subclass sets -------------------------------------------------
    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    paper: ClassVar[str] = ""
    layouts: ClassVar[tuple[str, ...]] = LAYOUTS
    # what the runtime must record for this policy (Observation: window, accumulate, inputs); the registry
    # refuses any other name
    observes: ClassVar[frozenset[Observation]] = frozenset()
    requires_budget: ClassVar[bool] = True
    # The schedule: when the selector fires besides "context_end"
    schedule: ClassVar[str] = "context_end"
    block_size: ClassVar[int | None] = None  # rows per block, for schedule "block"
    # schedule "block": a forward that adds more than ``block_size`` rows (a one-shot prefill) closes each full block
    # of ``block_size`` rows in turn, each selected on its own as if the forward had been chunked at ``block_size``,
    # and leaves the rest open (False: one event over all the rows since the last, then back to the target)
    closes_each_block: ClassVar[bool] = False
    dense_layers: ClassVar[int] = 0  # the first layers (by rank among compressed layers) never compressed
    # the most rows a layer's attended tier gains between two events after the context, where the schedule does not
    # say it (None: one row for "step", block_size for "block", no bound for "context_end"; Quest's kernel rule: a
    # page). TieredCache(..., capacity=N) sizes the tier's storage by it; too small is safe (the storage then grows)
    rows_between_events: ClassVar[int | None] = None
    # whether a decode step's own row is the archive's next row (every row but the sinks leaves for the archive after
    # its forward: Quest's eval rule); a decode step's archive view then carries that row (ArchiveView.own_row), for a
    # retriever that scores the page the row will join (Quest's current page). False: the view carries none
    own_row_archived_next: ClassVar[bool] = False
    # the fields of this policy that the retriever it names takes, so one setting is never held twice with two
    # values (Quest: page_size, gqa, rule; registry.check_retriever_params refuses a retriever object that differs)
    retriever_fields: ClassVar[tuple[str, ...]] = ()

    def __post_init__(self) -> None:
        self.validate()

    # --- configuration -----------------------------------------------------------------------
    @property
    def observation_window(self) -> int:
        """How many of the latest queries to keep for ``window_attention`` (0: none)."""
        return 0

    def __call__(self, *args: Any, **kwargs: Any) -> NoReturn:
        """A policy is not a kvpress press (kvpress's pipeline calls its press with the model)."""
        raise TypeError(f"{type(self).__name__} is a kvzoo policy, not a kvpress press: pass "
                        "kvzoo.integrations.kvpress.to_press(policy) to kvpress's pipeline (press=...)")

    def validate(self) -> None:
        """Raise ValueError/TypeError naming the bad field and what is valid."""
        if self.ratio is not None and self.budget is not None:
            raise ValueError(
                f"{self.name or type(self).__name__}: give either ratio= or budget=, not both "
                f"(got ratio={self.ratio}, budget={self.budget})"
            )
        if self.ratio is not None:
            if isinstance(self.ratio, bool) or not isinstance(self.ratio, (int, float)):
                raise TypeError(f"ratio must be a number >= 1 (keep 1/ratio of the rows), got {self.ratio!r}")
            if not math.isfinite(self.ratio) or self.ratio < 1:
                raise ValueError(f"ratio must be a finite number >= 1 (keep 1/ratio of the rows), got {self.ratio}")
            if self.ratio == 1:
                warnings.warn(f"{self.name or type(self).__name__}(ratio=1) keeps every row: it compresses nothing "
                              "(the policy still runs its selection); use 'full' for no compression, or ratio > 1",
                              UserWarning, stacklevel=3)
        if self.budget is not None:
            if isinstance(self.budget, bool) or not isinstance(self.budget, int):
                raise TypeError(f"budget must be an int >= 1 (rows kept per layer and KV group), got {self.budget!r}")
            if self.budget < 1:
                raise ValueError(f"budget must be >= 1 (rows kept per layer and KV group), got {self.budget}")
        if self.requires_budget and self.ratio is None and self.budget is None:
            raise ValueError(
                f"{self.name or type(self).__name__} needs a budget: pass ratio= (e.g. ratio=4 keeps 1/4 of the "
                f"rows) or budget= (rows kept per layer and KV group)"
            )
        if self.archive is None:  # an archive is kept where a retriever reads it; an eviction-only policy frees
            self.archive = self.retriever is not None
        if not isinstance(self.archive, bool):
            raise TypeError(f"archive must be True (keep evicted rows), False (drop them) or None (keep them exactly "
                            f"when a retriever reads them), got {self.archive!r}")
        if self.retriever is not None and not isinstance(self.retriever, (str, Retriever)):
            raise TypeError(
                "retriever must be a registered retriever name (kvzoo.registry.retrievers()), a Retriever object "
                f"(kvzoo.registry.build_retriever(name, **params)) or None, got {self.retriever!r}"
            )

    def config(self) -> dict[str, Any]:
        """The full configuration: name plus every field (what results files record)."""
        return {"name": self.name, **dataclasses.asdict(self)}

    # --- budget ----------------------------------------------------------------------------
    def resolve_budget(self, rows_seen: int) -> int | None:
        """Rows to keep for a layer that has seen ``rows_seen`` rows; None means keep all."""
        if self.budget is not None:
            return self.budget
        if self.ratio is not None:
            return max(1, int(rows_seen / self.ratio))
        return None

    def check_budget(self, budget: int, source: str = "budget") -> None:
        """Raise ValueError when ``budget`` rows (resolved from ``source``) cannot hold this policy's rows.

        One rule for a ``budget=`` given and for one a ``ratio`` resolves to: ``validate`` calls it for
        the first, the runtime for the second. The default accepts any budget of one row or more.
        """
        return None

    def target_rows(
        self, event: Event, *, budget: int | None, resident: int, block_rows: int = 0, seen: int = 0
    ) -> int | None:
        """How many rows the attended tier should hold after ``event``, or None to leave it.

        ``budget`` is the layer's budget (resolved once by the runtime; None for a policy without
        one), ``resident`` the rows the tier holds, ``block_rows`` how many of them arrived since
        the layer's previous event (the closing block), ``seen`` the rows appended so far (the true
        sequence length). The default holds the attended tier at the budget.
        """
        if budget is None or resident <= budget:
            return None
        return budget

    # --- the selector ----------------------------------------------------------------------
    @abstractmethod
    def priority(self, rows: RowsView, keep: int) -> torch.Tensor:
        """The policy's rule, as a score: fp32 ``[B, G, N]``, the ``keep`` highest rows stay (ties to the earlier row).

        Rows the rule always keeps score ``+inf``, padding ``-inf`` (:func:`forced_priority`). A ``step`` policy's
        per-step victim is the lowest score on the tier as stored, in any row order: read ``slots``, never positions.
        """

    def select(self, rows: RowsView, keep: int) -> torch.Tensor:
        """Indices of the rows to keep (``keep < rows.num_rows``): int64 ``[B, G, keep]``, sorted ascending; by default
        the top ``keep`` rows of :meth:`priority`. Override only for a rule that is not a top-k of a score."""
        return top_rows(self.checked_priority(rows, keep, event=True), keep, None if rows.all_valid else rows.valid)

    def checked_priority(self, rows: RowsView, keep: int, *, event: bool = False) -> torch.Tensor:
        """:meth:`priority` held to its contract: a float tensor ``[B, G, N]`` on the rows' device; ``event``: at a
        compression event, also no NaN (checked on the device; a per-step victim is not checked: that would cost every
        decode step). A raising ``priority`` is named (:func:`~kvzoo.framework.plugins.plugin_failed`)."""
        try:  # a plugin's rule: its fault names it (a try costs nothing until it raises)
            scores = self.priority(rows, keep)
        except Exception as err:
            plugin_failed(self, "policy", "priority", err)
        slots = rows.slots
        if not isinstance(scores, torch.Tensor) or not scores.is_floating_point() or scores.shape != slots.shape \
                or scores.device != slots.device:
            _refuse_scores(self, scores, slots)
        if event:
            contract = _priority_contract(slots)
            torch._assert_async(~torch.isnan(scores).any(),
                                f"{plugin_label(self, 'policy')}: priority() returned NaN scores; {contract}")
        return scores

    def multi_token_window(self, budget: int) -> tuple[int, int] | None:
        """``(sinks, window)`` when each token of a multi-token forward may read only the first
        ``sinks`` rows and the ``window`` latest rows up to its own (StreamingLLM's token-by-token
        prefill); None (default): every earlier row of the attended tier."""
        return None

    def step_victim(self, rows: RowsView) -> torch.Tensor | None:
        """For a ``step`` event that evicts exactly one row: int64 ``[B, G]``, the row each gives up -- by default
        the one ``select(rows, rows.num_rows - 1)`` leaves out, the lowest :meth:`priority` (ties to the latest slot).

        The named row leaves and the tier's last row takes its place (no gather of the tier), so the rows may be in
        any order. An override returning None makes the runtime sort the tier and call :meth:`select`.
        """
        return _lowest_priority_victim(self.checked_priority(rows, rows.num_rows - 1), rows.slots,
                                       None if rows.all_valid else rows.valid)


def check_schedule(policy: Policy) -> None:
    """ValueError naming ``policy`` unless its schedule is one the runtime fires (:data:`SCHEDULES`), with a block size
    for ``"block"``: checked where a cache takes the policy, after the policy's own ``validate`` (whose message, where
    it checks a schedule field, is the more specific)."""
    schedule, block = policy.schedule, policy.block_size
    if schedule not in SCHEDULES:
        raise ValueError(f"{plugin_label(policy, 'policy')}: schedule={schedule!r} is not a schedule; valid: "
                         f"{', '.join(SCHEDULES)} (the runtime fires no other)")
    if schedule == "block" and (isinstance(block, bool) or not isinstance(block, int) or block < 1):
        raise ValueError(f"{plugin_label(policy, 'policy')}: schedule 'block' needs block_size, an int >= 1 (rows per "
                         f"block), got {block!r}")


def _priority_contract(slots: torch.Tensor) -> str:
    return (f"priority() must return a float tensor [B, G, N] = {list(slots.shape)} on the rows' device: one score "
            "per row of the attended tier, +inf for rows always kept, -inf for padding")


def _refuse_scores(policy: Policy, scores: Any, slots: torch.Tensor) -> NoReturn:
    """The error :meth:`Policy.checked_priority` raises for scores off the contract, naming the policy."""
    where, contract = plugin_label(policy, "policy"), _priority_contract(slots)
    if not isinstance(scores, torch.Tensor):
        raise TypeError(f"{where}: {contract}; got {type(scores).__name__}")
    if not scores.is_floating_point():
        raise TypeError(f"{where}: {contract}; got a {scores.dtype} tensor")
    if scores.shape != slots.shape:
        raise ValueError(f"{where}: {contract}; got shape {list(scores.shape)}")
    raise ValueError(f"{where}: {contract}; got scores on device {scores.device}, the rows are on {slots.device} "
                     "(compute the scores from the view's tensors, or move them with .to(rows.slots.device))")


def require_int(value: Any, field_name: str, low: int, meaning: str = "") -> None:
    """ValueError naming ``field_name`` unless ``value`` is an int (not a bool) ``>= low``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        what = f" ({meaning})" if meaning else ""
        raise ValueError(f"{field_name} must be an int >= {low}{what}, got {value!r}")


# --- rows by age, read by slot: the rows may be in any order ---------------------------------------------------


def _valid_by_slot(slots: torch.Tensor, valid: torch.Tensor, count: int, all_valid: bool, latest: bool
                   ) -> torch.Tensor:
    """Bool ``[..., n]``: the ``count`` valid rows with the largest (``latest``: :meth:`RowsView.recent`) or the
    smallest slots (:meth:`RowsView.sinks`). ``all_valid``: no row is padding (fewer ops)."""
    if count <= 0:
        return torch.zeros_like(valid)
    k = min(count, slots.shape[-1])
    if all_valid:
        threshold = slots.topk(k, dim=-1, largest=latest).values[..., -1:]
        return slots >= threshold if latest else slots <= threshold
    padding = -1 if latest else torch.iinfo(slots.dtype).max  # never among the k
    threshold = torch.where(valid, slots, padding).topk(k, dim=-1, largest=latest).values[..., -1:]
    return valid & (slots >= threshold if latest else slots <= threshold)


def sinks_and_recent(slots: torch.Tensor, valid: torch.Tensor, sinks: int, recent: int, *,
                     query_slots: torch.Tensor | None = None) -> torch.Tensor:
    """StreamingLLM's rule, the one statement of it in kvzoo: bool ``[B, G, N]``, each sequence's ``sinks`` earliest
    and ``recent`` latest valid rows, by slot (the rows in any order).

    ``query_slots [q]``: the rule for each query of a multi-token forward, ``[B, G, q, N]``: the sinks, and the
    ``recent`` latest valid rows up to the query's own slot, as if the tokens came one at a time (and the query's own
    row, which a query always reads). Rows after a query's slot may be marked: causality is the attention's.
    """
    # how many valid rows have a slot <= each row's (its 1-based age among the valid rows), in any row order
    order = slots.argsort(dim=-1)
    counted = valid.gather(-1, order).long().cumsum(-1)  # [B, G, N], in slot order
    count = torch.empty_like(counted).scatter_(-1, order, counted)
    if query_slots is None:
        newest = counted[..., -1:]  # [B, G, 1]: the sequence's valid rows
        return valid & ((count <= sinks) | (count > newest - recent))
    # each query's count of valid rows up to its slot: [B, G, q, 1]
    upto = torch.searchsorted(slots.gather(-1, order).contiguous(), query_slots.expand(*slots.shape[:-1], -1).contiguous(),
                              right=True)
    newest = torch.where(upto > 0, counted.gather(-1, (upto - 1).clamp(min=0)), 0)[..., None]
    count, row_valid = count[..., None, :], valid[..., None, :]
    own = slots[..., None, :] == query_slots[:, None]
    return (row_valid & ((count <= sinks) | (count > newest - recent))) | own  # bool compares: no [q, N] ints


def _sinks_and_recent_victim(slots: torch.Tensor, valid: torch.Tensor, sinks: int,
                             all_valid: bool = False) -> torch.Tensor:
    """The row ``sinks_and_recent(slots, valid, sinks, N - 1 - sinks)`` leaves out, ``[B, G]`` (rows in any order):
    the oldest valid row past the sinks, or, where a sequence has padding, its earliest padding row. One top-k over
    the slots: the few ops a decode step may launch (``tests/test_static_step.py`` bounds them)."""
    n = slots.shape[-1]
    sinks = min(sinks, n - 1)
    if all_valid:
        return slots.topk(sinks + 1, dim=-1, largest=False).indices[..., -1]
    # padding rows sort before every valid row (by slot among themselves): one top-k finds the earliest padding row
    # and the oldest valid row past the sinks
    key = torch.where(valid, slots, slots - (1 << 62))
    top = key.topk(sinks + 1, dim=-1, largest=False)
    return torch.where(top.values[..., 0] < 0, top.indices[..., 0], top.indices[..., -1])


@dataclass
class SinksAndRecentPolicy(Policy):
    """The rule of StreamingLLM (and of Quest's attended tier): the first ``sinks`` rows, then the latest ones
    (:func:`sinks_and_recent`). A subclass writes no selector."""

    sinks: int = 4

    def validate(self) -> None:
        super().validate()
        require_int(self.sinks, "sinks", 0, "attention sinks kept at the start")

    def priority(self, rows: RowsView, keep: int) -> torch.Tensor:
        """The sinks ``+inf``, every other row by recency (its slot): the top ``keep`` are
        ``sinks_and_recent(slots, valid, sinks, keep - sinks)`` (valid rows rank first; where a sequence has fewer
        valid rows than ``keep``, its latest padding rows fill the rest)."""
        sinks = sinks_and_recent(rows.slots, rows.valid, self.sinks, 0)
        return rows.slots.float().masked_fill(sinks, math.inf)

    def step_victim(self, rows: RowsView) -> torch.Tensor:
        return _sinks_and_recent_victim(rows.slots, rows.valid, self.sinks, rows.all_valid)


# the step_victim() methods the framework writes: each names a row of the tier by construction (the runtime checks the
# victims of any other)
FRAMEWORK_VICTIMS = (Policy.step_victim, SinksAndRecentPolicy.step_victim)


def _lowest_priority_victim(priority: torch.Tensor, slots: torch.Tensor,
                            valid: torch.Tensor | None = None) -> torch.Tensor:
    """The row :func:`top_rows` leaves out when keeping all but one, on rows in any order: the lowest ``priority``
    ``[B, G, n]`` (fp32, ``-inf`` for padding, ``+inf`` for forced rows), ties to the latest slot; with ``valid``, a
    padding row before any valid one (the lowest padding row, whatever the valid rows scored)."""
    if valid is not None:  # where a sequence has padding, only its padding rows compete
        has_padding = (~valid).any(dim=-1, keepdim=True)
        priority = priority.masked_fill(has_padding & valid, math.inf)
    lowest = priority == priority.amin(dim=-1, keepdim=True)
    return torch.where(lowest, slots, -1).argmax(dim=-1)


def forced_priority(scores: torch.Tensor, forced: torch.Tensor, valid: torch.Tensor,
                    all_valid: bool = False) -> torch.Tensor:
    """``scores`` as fp32 with the ``forced`` rows at ``+inf`` and padding at ``-inf``, ``[B, G, N]``
    (``all_valid``: no row is padding)."""
    if all_valid:
        return scores.float().masked_fill(forced, math.inf)
    return scores.float().masked_fill(~valid, -math.inf).masked_fill(forced, math.inf)


def top_rows(priority: torch.Tensor, keep: int, valid: torch.Tensor | None = None) -> torch.Tensor:
    """Sorted indices ``[B, G, keep]`` of the ``keep`` highest ``priority`` rows, ties toward the earlier row; with
    ``valid``, every valid row ranks before every padding row (each in priority order), whatever the scores."""
    order = torch.sort(priority, dim=-1, descending=True, stable=True).indices  # stable: earlier rows first
    if valid is not None:
        first = torch.sort(valid.gather(-1, order).to(torch.uint8), dim=-1, descending=True, stable=True).indices
        order = order.gather(-1, first)
    return order[..., :keep].sort(dim=-1).values  # ascending: kept rows stay in sequence order


# --- the observation window (SnapKV, ChunkKV) ------------------------------------------------


def window_rows_mask(rows: RowsView) -> torch.Tensor:
    """Bool ``[B, G, N]``: the rows of the observation window's own tokens (the last ``w`` valid rows)."""
    w = rows.window_size()
    if not w:
        raise RuntimeError(
            "the observation window was not recorded for this layer; the policy must list 'window' in "
            "`observes` and return a positive `observation_window`"
        )
    return rows.recent(w)


WINDOW_POOLINGS = ("maxpool", "avgpool")
WINDOW_AGGREGATES = ("sum", "mean", "max")


def window_votes(rows: RowsView, kernel_size: int = 1, pooling: str = "maxpool", aggregate: str = "sum") -> torch.Tensor:
    """Each row's votes from the observation window, ``[B, G, N]`` fp32 (SnapKV's scores; ChunkKV's before chunking).

    The window queries' attention summed over the window, the window rows' own votes zeroed (the reference slices
    them off before pooling: a zero there is its padding), pooled along the rows per query head (stride 1, padding
    ``kernel_size // 2``), then the query heads of each KV group combined by ``aggregate``.
    """
    attn = rows.observed_window()  # [B, H, w, N]
    window = window_rows_mask(rows)  # [B, G, N]
    B, H, _, N = attn.shape
    G = rows.keys.shape[1]
    hpg = H // G
    votes = attn.float().sum(dim=2)  # [B, H, N]
    in_window = window[:, :, None, :].expand(B, G, hpg, N).reshape(B, H, N)
    votes = votes.masked_fill(in_window, 0.0)
    if kernel_size > 1:
        pool = F.max_pool1d if pooling == "maxpool" else F.avg_pool1d
        votes = pool(votes.reshape(B * H, 1, N), kernel_size=kernel_size, stride=1,
                     padding=kernel_size // 2).reshape(B, H, N)
    grouped = votes.view(B, G, hpg, N)
    if aggregate == "sum":
        return grouped.sum(dim=2)
    if aggregate == "mean":
        return grouped.mean(dim=2)
    return grouped.amax(dim=2)


def validate_votes(kernel_size: Any, pooling: Any, aggregate: Any) -> None:
    """The checks of :func:`window_votes`'s settings (SnapKV's and ChunkKV's fields)."""
    if isinstance(kernel_size, bool) or not isinstance(kernel_size, int) or kernel_size < 1 or kernel_size % 2 == 0:
        raise ValueError(
            f"kernel_size must be an odd int >= 1 (pooling width; stride 1 with padding kernel_size // 2 "
            f"keeps one score per row only for odd widths; 1 = no pooling), got {kernel_size!r}"
        )
    if pooling not in WINDOW_POOLINGS:
        raise ValueError(f"pooling must be one of {WINDOW_POOLINGS}, got {pooling!r}")
    if aggregate not in WINDOW_AGGREGATES:
        raise ValueError(
            f"aggregate must be one of {WINDOW_AGGREGATES} (how the query heads of one KV head combine), got {aggregate!r}"
        )


def check_window_fits(name: str, rows: RowsView, keep: int) -> None:
    """ValueError when the always-kept window does not fit in ``keep`` rows. Reads lengths only
    (:meth:`RowsView.window_size`): a layer that reuses another's indices computes no window attention here."""
    w = rows.window_size()
    if keep < w:
        raise ValueError(
            f"{name}: layer {rows.layer_idx} may keep {keep} rows, fewer than the observation window of {w} rows "
            f"that is always kept (the tier holds {rows.num_rows} rows); use a smaller window= (<= {keep}), a "
            f"larger budget=, or a smaller ratio= (<= {rows.num_rows / w:g})"
        )


@dataclass
class WindowPolicy(Policy):
    """A policy that reads the observation window: the attention of the last ``window`` queries over the rows,
    which are always kept (SnapKV, ChunkKV). A subclass writes :meth:`Policy.priority` from
    :func:`window_votes` (forcing :func:`window_rows_mask`); the selector refuses a ``keep`` below the window."""

    window: int = 32

    observes: ClassVar[frozenset[Observation]] = frozenset({Observation.WINDOW})

    @property
    def observation_window(self) -> int:
        return self.window

    def validate(self) -> None:
        super().validate()
        require_int(self.window, "window", 1, "observation-window queries, always kept")
        if self.budget is not None and self.budget < self.window:
            raise ValueError(
                f"window ({self.window}) is larger than budget ({self.budget}): the observation window is always "
                f"kept inside the budget; use window <= {self.budget} or budget >= {self.window}"
            )

    def select(self, rows: RowsView, keep: int) -> torch.Tensor:
        check_window_fits(self.name, rows, keep)
        return super().select(rows, keep)
