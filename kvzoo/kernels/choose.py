"""A decode step's fused retrieval ops: each a PyTorch reference beside the C op that does its work in one call.

On a CPU decode step a retriever's choice was a chain of 20-60 small torch ops per layer; each op here is one call of
:mod:`kvzoo.kernels.cpu_native` (a registered torch op). Its ``*_reference`` is the specification, op for op the
torch path kvzoo always ran (``tests/test_native_choose.py`` holds each op to it, up to fp32 summation order). The
public name takes the C op on the CPU tensors it takes when ``KVZOO_KERNELS`` is ``auto``, the reference elsewhere. A
choose op counts what it stages (int64 0-dim), added in place to ``counter`` when given. VestigeKV's int8 rule,
:func:`~kvzoo.kernels.index_scan.int8_choose`, sits beside its scan.
"""

from __future__ import annotations

import torch

from kvzoo.kernels import cpu_native
from kvzoo.kernels.dispatch import mode
from kvzoo.kernels.index_scan import (
    SKETCH_SLACK,
    _check_valid,
    count_picked,
    index_scan,
    index_scan_reduce,
    page_entries,
    sketch_query,
    unique_candidates,
)

RANK_BY = ("estimate", "bound")


def _shape_is(op: str, name: str, t: torch.Tensor | None, *want: int | tuple[int, ...] | None) -> None:
    """A ValueError unless ``t`` (None: nothing to check) has the shape ``want``: per dimension a size, a tuple of the
    sizes allowed, or None for any. Shapes only, never a value (no host sync on a GPU); the C op checks the same and
    the value ranges too (``csrc/ops.cpp``)."""
    if t is None or (t.dim() == len(want) and all(w is None or (n in w if isinstance(w, tuple) else n == w)
                                                  for n, w in zip(t.shape, want))):
        return
    shown = ", ".join("*" if w is None else " or ".join(map(str, w)) if isinstance(w, tuple) else str(w) for w in want)
    raise ValueError(f"{op}: {name} must have shape [{shown}], got {list(t.shape)}")


def _one_device(op: str, first: torch.Tensor, **tensors: torch.Tensor | None) -> None:
    """A ValueError naming the first tensor (None: absent) not on ``first``'s device: torch takes a 0-dim CPU tensor,
    or a ``meta`` index, beside another device's tensors without a word (a ``gather`` so read garbage)."""
    for name, t in tensors.items():
        if t is not None and t.device != first.device:
            raise ValueError(f"{op}: {name} is on {t.device}, the first input on {first.device}: put them on one "
                             "device")


# --- VestigeKV's sketch --------------------------------------------------------------------------------------------


def sketch_choose_reference(query: torch.Tensor, basis: torch.Tensor, entries: torch.Tensor, floor: torch.Tensor,
                            j: int, archived: int, scaling: float, *, slack: float = SKETCH_SLACK,
                            rank_by: str = "estimate", length: torch.Tensor | None = None,
                            counter: torch.Tensor | None = None,
                            valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`sketch_choose` in PyTorch: the query rows (:func:`~kvzoo.kernels.index_scan.sketch_query`), one scan
    for the bounds and the estimates (the query rows without eta's and the slack columns), each query row's top ``j``
    by the ranking score, kept where the bound is above ``floor``, then :func:`unique_candidates` and the count. A
    row flagged False in ``valid`` ranks ``-inf`` and is never kept."""
    _shape_is("sketch_choose", "query", query, None, None, None, None)
    _one_device("sketch_choose", query, basis=basis, entries=entries, floor=floor, length=length, counter=counter)
    B, G, hq, D = query.shape
    _shape_is("sketch_choose", "basis", basis, (B, 1), G, None, None)
    _shape_is("sketch_choose", "floor", floor, B, G, hq)
    if archived < 1:  # the sentinel of rows not picked, clamped to archived - 1: a row
        raise ValueError(f"sketch_choose: archived must be >= 1, got {archived}")
    dc, r = basis.shape[2], basis.shape[3]
    m = entries.shape[2]
    dead = None
    if valid is not None:
        _check_valid("sketch_choose", valid, B, G, m)
        dead = ~valid[:, :, None, :m]  # [B, G, 1, m]
    heads = query.reshape(B, G * hq, 1, D)  # sketch_query groups the heads again: [B, G, hq, W]
    branch = heads[..., dc:] if D > dc else None
    qrows = sketch_query(heads[..., :dc], branch, basis, slack=slack)
    if rank_by == "estimate":
        W = qrows.shape[-1]
        in_span = qrows.clone()
        # eta's column and the slack's, zeroed by a select and a slice: no index tensor built on the host (on a GPU
        # a host-to-device copy per layer-step, which a CUDA graph cannot capture)
        in_span[..., r] = 0
        in_span[..., W - (2 if branch is not None else 1):] = 0
        both = index_scan(torch.cat([qrows, in_span], dim=2), entries, scaling, length=length)  # one scan
        bounds, ranking = both[:, :, :hq], both[:, :, hq:]
        if dead is not None:
            bounds, ranking = bounds.masked_fill(dead, float("-inf")), ranking.masked_fill(dead, float("-inf"))
        rows = ranking.topk(j, dim=-1).indices  # [B, G, hq, j]
        ok = bounds.gather(-1, rows) > floor[..., None]
    else:
        bounds = index_scan(qrows, entries, scaling, length=length)
        if dead is not None:
            bounds = bounds.masked_fill(dead, float("-inf"))
        top, rows = bounds.topk(j, dim=-1)
        ok = top > floor[..., None]
    idx, picked = unique_candidates(rows.view(B, G, -1), ok.view(B, G, -1), archived)
    return idx, picked, count_picked(picked, counter)


def sketch_choose(query: torch.Tensor, basis: torch.Tensor, entries: torch.Tensor, floor: torch.Tensor, j: int,
                  archived: int, scaling: float, *, slack: float = SKETCH_SLACK, rank_by: str = "estimate",
                  length: torch.Tensor | None = None, counter: torch.Tensor | None = None,
                  valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """VestigeKV's top-j rule over its sketch for grouped decode queries: ``(idx, picked) [B, G, hq * j]``, ``count``.

    ``query [B, G, hq, D]`` fp32 (MLA: the absorbed content part first, then the rope branch), ``basis [B, G, dc,
    r]``, ``entries [B, G, m, W]`` fp32 or fp16 (:func:`~kvzoo.kernels.index_scan.sketch_entries`; a preallocated
    buffer may be passed whole with ``length [B]``), ``floor [B, G, hq]`` (``s* - j_margin``), ``archived`` the
    staging's sentinel (:func:`unique_candidates`), ``slack`` ``SKETCH_SLACK`` (``SKETCH_SLACK_FP16`` for fp16
    entries), ``rank_by`` ``"estimate"`` (the bound less its Cauchy-Schwarz term and slack) or ``"bound"``. Per query
    row its top ``j`` by the ranking (an earlier row first among equals), kept where its bound is above ``floor``.
    ``valid [B, G, >= m]`` bool (None: every row is one): a row flagged False (padding) is never ranked nor kept."""
    if rank_by not in RANK_BY:
        raise ValueError(f"rank_by must be one of {RANK_BY}, got {rank_by!r}")
    if mode() == "auto" and cpu_native.sketch_choose_supported(query, basis, entries, floor, j, counter, valid):
        return cpu_native.sketch_choose(query, basis, entries, length, floor, j, archived, scaling, slack,
                                        rank_by == "bound", counter, valid)
    return sketch_choose_reference(query, basis, entries, floor, j, archived, scaling, slack=slack, rank_by=rank_by,
                                   length=length, counter=counter, valid=valid)


# --- Quest's pages --------------------------------------------------------------------------------------------------


def _page_rows(pages: torch.Tensor, size: int, shift: torch.Tensor | None = None) -> torch.Tensor:
    """Page indices ``[B, G, ..., n]`` -> their rows ``[B, G, ... x n x size]``, page after page (less ``shift [B,
    G]``, the virtual rows before each archive: negative rows are none)."""
    B, G = pages.shape[:2]
    rows = (pages[..., None] * size + torch.arange(size, device=pages.device)).view(B, G, -1)
    return rows if shift is None else rows - shift[..., None]


def _page_row_valid(rows: torch.Tensor, live: torch.Tensor, pages: torch.Tensor, slots: int, size: int,
                    shift: torch.Tensor | None) -> torch.Tensor:
    """A row of a page (``pages``: the top pages, ``slots`` none) below ``live`` (with shifts: of a page, not a
    virtual row before the archive)."""
    if shift is None:
        return rows < live.clamp(max=slots * size)
    B, G = pages.shape[:2]
    of_a_page = (pages[..., None] < slots).expand(*pages.shape, size).reshape(B, G, -1)
    return of_a_page & (rows >= 0) & (rows < live)


def _top_pages(bounds: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``n`` greatest bounds of each row and their pages, as the C op takes them: a NaN bound ranked as ``+inf``
    (first), an earlier page first among equal ranks (a stable sort: ``torch.topk`` leaves ties in no stated order and
    ranks NaN above ``+inf``; a NaN or an infinity in the query makes such ties above ``-inf``)."""
    ranked = torch.where(bounds.isnan(), float("inf"), bounds)
    values, pages = ranked.sort(dim=-1, descending=True, stable=True)
    return values[..., :n], pages[..., :n]


def _no_page_at_minus_inf(top: tuple[torch.Tensor, torch.Tensor], slots: int) -> torch.Tensor:
    """The top pages (:func:`_top_pages`), those of bound ``-inf`` (an empty page: nothing to read) as page ``slots``,
    past the last: no page -- sorted last, its rows past every page's, never valid nor counted (before, a padding page
    inside ``live`` could be taken and its rows counted as fetched)."""
    values, pages = top
    return torch.where(values == float("-inf"), slots, pages)


def _quest_shapes(query: torch.Tensor, entries: torch.Tensor, empty: torch.Tensor, live: torch.Tensor,
                  positions: torch.Tensor | None, pages: int, size: int, archived: int,
                  own: tuple[torch.Tensor, ...] | None) -> None:
    """:func:`quest_choose`'s shapes and sizes (a ValueError; the values are the C op's to check)."""
    op = "quest_choose"
    _shape_is(op, "query", query, None, None, None, None)
    _one_device(op, query, entries=entries, empty=empty, live=live, positions=positions,
                **dict(zip(("own_keys", "own_valid", "own_position", "open_min", "open_max"), own or ())))
    B, G, hq, D = query.shape
    _shape_is(op, "entries", entries, B, G, None, 2 * D + 1)
    P = entries.shape[2]
    _shape_is(op, "empty", empty, B, G, P)
    if live.numel() != 1:
        raise ValueError(f"{op}: live must have one element, got shape {list(live.shape)}")
    _shape_is(op, "positions", positions, B, G, None)
    if own is not None:
        keys, valid, position, open_min, open_max = own
        _shape_is(op, "own_keys", keys, B, G, None, D)
        _shape_is(op, "own_valid", valid, B, G, keys.shape[2])
        _shape_is(op, "own_position", position, B, G)
        _shape_is(op, "open_min", open_min, B, G, D)
        _shape_is(op, "open_max", open_max, B, G, D)
    if not (1 <= pages <= P + (own is not None) and size >= 1 and archived >= 1):
        raise ValueError(f"{op}: 1 <= pages <= P (P + 1 with the own row), size >= 1 and archived >= 1, got "
                         f"pages={pages} of P={P}, size={size}, archived={archived}")


def _joined_bounds(keys: torch.Tensor, valid: torch.Tensor, position: torch.Tensor, open_min: torch.Tensor,
                   open_max: torch.Tensor, opens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The row at ``position`` (``keys [B, G, N, D]``, upcast; padding contributes nothing) joined to the open page's
    running min/max ``[B, G, D]``, or alone where ``opens`` (the row opens a page): ``(lo, hi) [B, G, D]``."""
    B, G, _, D = keys.shape
    at = position.reshape(B, G, 1)
    row = keys.gather(2, at[..., None].expand(B, G, 1, D))[:, :, 0].float()  # [B, G, D]
    ok = valid.gather(2, at)  # [B, G, 1]
    lo = row.masked_fill(~ok, float("inf"))
    hi = row.masked_fill(~ok, float("-inf"))
    return torch.where(opens, lo, torch.minimum(open_min, lo)), torch.where(opens, hi, torch.maximum(open_max, hi))


def quest_page_entries(lo: torch.Tensor, hi: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Quest's page entries ``[max, min, max |k|]`` ``[B, G, p, 2 D + 1]`` in ``dtype`` (each one of the page's key
    values: exact) from the pages' fp32 min/max ``lo``/``hi [B, G, p, D]`` (``+inf``/``-inf`` over padding), and their
    empty flags ``[B, G, p]`` (a page of padding only: its magnitude 0, never fetched)."""
    entries = page_entries(lo, hi)
    entries[..., -1:] = entries[..., -1:].masked_fill(torch.isinf(lo).all(-1, keepdim=True), 0.0)
    return entries.to(dtype), torch.isinf(lo).all(-1) & torch.isinf(hi).all(-1)


def quest_choose_reference(query: torch.Tensor, entries: torch.Tensor, empty: torch.Tensor, live: torch.Tensor,
                           positions: torch.Tensor | None, pages: int, size: int, archived: int, scaling: float, *,
                           per_head: bool = True, counter: torch.Tensor | None = None,
                           own: tuple[torch.Tensor, ...] | None = None, shift: torch.Tensor | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """:func:`quest_choose` in PyTorch: with ``own``, one page slot more holding the current page's entry with the
    step's key; the page bounds (``page_query`` rows, :func:`~kvzoo.kernels.index_scan.index_scan`, or
    ``index_scan_reduce`` over the group's heads), empty pages at ``-inf``, the top pages (each head's in ascending
    page order; one at ``-inf`` no page: :func:`_no_page_at_minus_inf`), their rows and flags, the union count, the
    storage positions gathered from ``positions``."""
    _quest_shapes(query, entries, empty, live, positions, pages, size, archived, own)
    _one_device("quest_choose", query, counter=counter)
    B, G, hq, D = query.shape
    if shift is not None:
        _shape_is("quest_choose", "shift", shift, B, G)
    at = live.view(1, 1) if shift is None else live + shift  # [B, G]: the next row's place (virtual rows counted)
    if own is not None:  # the current page with the step's key, in its slot; one slot more for a page it opens
        lo, hi = _joined_bounds(*own, (at % size == 0)[..., None])  # the summary is left as it is
        entry, unused = quest_page_entries(lo[:, :, None], hi[:, :, None], entries.dtype)
        page = torch.div(at, size, rounding_mode="floor").expand(B, G)[..., None]  # [B, G, 1]
        entries = torch.cat([entries, torch.zeros_like(entry)], 2).scatter_(
            2, page[..., None].expand(B, G, 1, entries.shape[-1]), entry)
        empty = torch.cat([empty, torch.ones_like(unused)], 2).scatter_(2, page, unused)
    slots = entries.shape[2]  # the summary's pages, and the own row's
    qrows = torch.cat([query.clamp(min=0), query.clamp(max=0), SKETCH_SLACK * query.abs().sum(-1, keepdim=True)],
                      dim=-1)  # page_query's rows
    if per_head:
        bounds = index_scan(qrows, entries, scaling).masked_fill(empty[:, :, None], float("-inf"))  # [B, G, hq, P]
        top = _no_page_at_minus_inf(_top_pages(bounds, pages), slots).sort(dim=-1).values  # each head's, ascending
        rows = _page_rows(top, size, shift)  # each head's rows, head after head
        valid = _page_row_valid(rows, live, top, slots, size, shift)  # a page's row below live
        union = torch.zeros(B, G, archived + 1, dtype=torch.bool, device=rows.device)
        union.scatter_(2, torch.where(valid, rows, archived), True)
        count = union[..., :archived].sum()
        rows = torch.minimum(rows, live - 1).clamp(min=0)
        if counter is not None:
            counter.add_(count)
    else:
        group_max = index_scan_reduce(qrows, entries, scaling, None).masked_fill(empty, float("-inf"))  # [B, G, P]
        top = _no_page_at_minus_inf(_top_pages(group_max, pages), slots)
        rows = _page_rows(top, size, shift)
        rows, valid = unique_candidates(torch.minimum(rows, live - 1).clamp(min=0),
                                        _page_row_valid(rows, live, top, slots, size, shift), archived)
        count = count_picked(valid, counter)
    return rows, None if positions is None else positions.gather(2, rows), valid, count


def quest_choose(query: torch.Tensor, entries: torch.Tensor, empty: torch.Tensor, live: torch.Tensor,
                 positions: torch.Tensor | None, pages: int, size: int, archived: int, scaling: float, *,
                 per_head: bool = True, counter: torch.Tensor | None = None,
                 own: tuple[torch.Tensor, ...] | None = None, shift: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """Quest's choice for grouped decode queries ``query [B, G, hq, D]`` (fp32): ``(rows, positions, valid) [B, G,
    K]`` and ``count``, from the page entries (:func:`quest_page_entries`), ``empty``, ``live`` (the rows indexed) and
    the archive list ``positions`` (or None). Each page's bound ``scale sum_i max(q_i min_i, q_i max_i)`` (+ slack),
    ``-inf`` when empty; the top ``pages`` (NaN ranked as ``+inf``, an earlier page first among equal ranks, in
    both), a top page at ``-inf`` none (its rows never valid nor counted: an empty page is
    never fetched). ``per_head``: ``K = hq x pages x size`` rows head after head, pages ascending (none last), clamped
    below ``live``, ``valid = row < live`` of a page; else the group's
    pages by the max over its heads, staged (:func:`unique_candidates`). ``own`` (``rule="eval"``): ``(keys, valid,
    position, open_min, open_max)``, the step's own row and the open page's min/max, joined for page ``live // size``
    (the summary is left as is). The values must hold ``live >= 1``, ``live // size <= P`` with ``own``, ``archived
    >= min(live, P' x size)`` (``P'``: the page slots read), ``positions`` of ``archived`` entries at least, the own
    row's position inside its storage: the C op checks them (a ValueError); the reference, which runs on a GPU too,
    checks the shapes only (a host sync per step otherwise). ``shift [B, G]`` (a padded batch's pages, from each
    sequence's first real row: :class:`~kvzoo.retrievers.quest.PageSummary`): page ``p`` holds rows ``p x size -
    shift`` on, the virtual ones before the archive never valid (``0 <= shift < size``: the C op checks it)."""
    if mode() == "auto" and cpu_native.quest_choose_supported(query, entries, empty, live, positions, counter, own,
                                                              shift):
        return cpu_native.quest_choose(query, entries, empty, live, positions, pages, size, archived, per_head,
                                       scaling, SKETCH_SLACK, counter, own, shift)
    return quest_choose_reference(query, entries, empty, live, positions, pages, size, archived, scaling,
                                  per_head=per_head, counter=counter, own=own, shift=shift)


def quest_page_add_reference(keys: torch.Tensor, valid: torch.Tensor, position: torch.Tensor,
                             open_min: torch.Tensor, open_max: torch.Tensor, entries: torch.Tensor,
                             empty: torch.Tensor, count: torch.Tensor, length: torch.Tensor, size: int) -> None:
    """:func:`quest_page_add` in PyTorch: the row gathered, masked where it is padding, then the running min/max, the
    page's entry and flag written at ``count // size``, ``count`` and ``length`` moved (what ``PageSummary._add_one``
    does with Quest's encoding, :func:`quest_page_entries`)."""
    op = "quest_page_add"
    _shape_is(op, "keys", keys, None, None, None, None)
    _one_device(op, keys, valid=valid, position=position, open_min=open_min, open_max=open_max, entries=entries,
                empty=empty, count=count, length=length)
    B, G, N, D = keys.shape
    _shape_is(op, "valid", valid, B, G, N)
    _shape_is(op, "position", position, B, G)
    _shape_is(op, "open_min", open_min, B, G, D)
    _shape_is(op, "open_max", open_max, B, G, D)
    _shape_is(op, "entries", entries, B, G, None, 2 * D + 1)
    _shape_is(op, "empty", empty, B, G, entries.shape[2])
    if count.numel() != 1 or length.numel() != 1 or size < 1:
        raise ValueError(f"{op}: count and length must have one element and size must be >= 1, got shapes "
                         f"{list(count.shape)} and {list(length.shape)}, size={size}")
    page = torch.div(count, size, rounding_mode="floor")  # on the device
    lo, hi = _joined_bounds(keys, valid, position, open_min, open_max, (count % size == 0).view(1, 1, 1))
    open_min.copy_(lo)
    open_max.copy_(hi)
    entry, unused = quest_page_entries(open_min[:, :, None], open_max[:, :, None], entries.dtype)  # [B, G, 1, ...]
    entries.index_copy_(2, page, entry)
    empty.index_copy_(2, page, unused)
    count.add_(1)
    length.copy_(torch.div(count + (size - 1), size, rounding_mode="floor"))


def quest_page_add(keys: torch.Tensor, valid: torch.Tensor, position: torch.Tensor, open_min: torch.Tensor,
                   open_max: torch.Tensor, entries: torch.Tensor, empty: torch.Tensor, count: torch.Tensor,
                   length: torch.Tensor, size: int) -> None:
    """One archived row (``keys [B, G, N, D]`` at ``position [B, G]``, its ``valid`` flag) joins Quest's fixed page
    summary in place: the open page's running ``open_min``/``open_max`` (opened when ``count % size == 0``), the
    page's entry and ``empty`` flag written at ``count // size``, then ``count += 1``, ``length = ceil(count / size)``:
    the same ops whatever the count (a captured step replays it); the caller checks there is room."""
    if mode() == "auto" and cpu_native.quest_page_add_supported(keys, valid, position, open_min, open_max, entries,
                                                                  empty, count, length):
        cpu_native.quest_page_add(keys, valid, position, open_min, open_max, entries, empty, count, length, size)
        return
    quest_page_add_reference(keys, valid, position, open_min, open_max, entries, empty, count, length, size)
