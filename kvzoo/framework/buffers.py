"""Row buffers: named tensors that share a row axis, preallocated, with the live row count on the device too.

The storage under a layer's rows and views and under the retrievers' indexes; torch only, no policy, model or
cache. A :class:`RowStore` holds tensors ``[B, G, capacity, ...]`` of which the first ``n`` rows are live; ``n`` is
kept on the host and on the device (``length``), so a decode step's single-row append launches the same ops
whatever the row count (what a CUDA graph needs). A *growing* store grows by a quarter when full and shrinks when
an eviction leaves it mostly empty; a *fixed* one (``TieredCache(..., capacity=N)``) changes only when asked or on
overflow, and its decode-step readers see whole buffers, the rows past ``n`` holding ``empty`` values. Rows leave
by :meth:`keep` (an event) or :meth:`vacate` (one in, one out: the next row appended fills the hole, after which
:meth:`ensure_order` sorts the rows back before anything reads their order).
"""

from __future__ import annotations

import torch

MIN_GROWTH = 64  # rows: the smallest step by which a growing store grows
GROWTH = 0.25  # grow by a quarter of the current capacity (amortised O(1) copies per appended row)

Fill = bool | int | float


def gather_rows(t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``t[b, g, idx[b, g, i], ...]`` for ``t [B, G, n, ...]`` and ``idx [B, G, k]``."""
    if t.dim() == 3:
        return t.gather(2, idx)
    return t.gather(2, idx.view(*idx.shape, *([1] * (t.dim() - 3))).expand(*idx.shape, *t.shape[3:]))


def complement(idx: torch.Tensor, n: int) -> torch.Tensor:
    """Indices ``[B, G, n - k]`` (ascending) of the rows ``[0, n)`` that ``idx [B, G, k]`` does not name."""
    kept = torch.zeros(*idx.shape[:2], n, dtype=torch.bool, device=idx.device).scatter_(2, idx, True)
    # a stable sort of the 0/1 mask puts the rows not kept first, in order
    return torch.sort(kept.to(torch.uint8), dim=2, stable=True).indices[:, :, : n - idx.shape[2]]


class RowStore:
    """Named tensors ``[B, G, capacity, ...]`` sharing a row axis; rows ``[:n]`` are live (``length`` on device)."""

    def __init__(self) -> None:
        self.buffers: dict[str, torch.Tensor] = {}
        self.capacity = 0  # rows each buffer has room for (kept by _refresh)
        self.n = 0  # live rows (host)
        self.length: torch.Tensor | None = None  # the same count on the buffers' device, int64 [1]
        self.ordered = True  # live rows are in the order they were appended (slot order)
        self.fixed = False  # fixed capacity: decode-step readers see whole buffers (module docstring)
        self.empty: dict[str, Fill] = {}  # what a row past n holds, per buffer that must never read as live
        self.growths = 0  # appends that overflowed a fixed capacity (each reallocated the buffers)
        self._offsets: torch.Tensor | None = None  # [B, G, 1] (b * G + g) * capacity, kept with the buffers
        # one in, one out (vacate): the row given up stays until the next row appended takes its place (hole [B, G])
        self.hole: torch.Tensor | None = None
        self.holed = False
        self.into_hole = False  # the latest single-row append filled the hole (rather than writing at length)

    # --- reading -----------------------------------------------------------------------------
    def __contains__(self, name: str) -> bool:
        return name in self.buffers

    def get(self, name: str) -> torch.Tensor:
        """The live rows of ``name``: a view ``[B, G, n, ...]`` of the buffer (no copy)."""
        if self.holed:
            self.settle()
        return self.buffers[name][:, :, : self.n]

    def reading(self, name: str) -> torch.Tensor:
        """What a decode step reads of ``name``: the whole buffer when the capacity is fixed (rows past ``n``
        hold ``empty`` values), else the live rows. The same tensor, shape and storage from step to step."""
        if self.fixed:
            return self.buffers[name]
        if self.holed:
            self.settle()
        return self.buffers[name][:, :, : self.n]

    # --- writing -----------------------------------------------------------------------------
    def define(self, batch: int, groups: int, fields: dict[str, tuple[tuple[int, ...], torch.dtype]],
               device: torch.device, capacity: int = 0, *, fixed: bool = False,
               empty: dict[str, Fill] | None = None) -> None:
        """Create the buffers ``name -> (trailing shape, dtype)``, each ``[batch, groups, capacity, *shape]``; ``empty``:
        the value of rows past ``n`` for the buffers named (written now and whenever rows leave)."""
        make = torch.zeros if fixed else torch.empty  # a fixed store's spare rows are read (masked): never NaN
        self.buffers = {
            name: make(batch, groups, capacity, *shape, dtype=dtype, device=device)
            for name, (shape, dtype) in fields.items()
        }
        self.empty = dict(empty or {}) if fixed else {}  # a growing store's readers never see past n
        for name, value in self.empty.items():
            self.buffers[name].fill_(value)
        self.n = 0
        self.length = torch.zeros(1, dtype=torch.long, device=device)
        self.ordered = True
        self.fixed = fixed
        self._refresh()

    def append(self, rows: dict[str, torch.Tensor | Fill], count: int | None = None) -> None:
        """Write ``count`` rows after the live rows: for every buffer a tensor ``[B, G, count, ...]`` or a scalar. One row
        (a decode step) is written at the device's ``length``: the ops' arguments do not depend on the row count."""
        if set(rows) != set(self.buffers):
            raise ValueError(f"append needs every buffer {sorted(self.buffers)}, got {sorted(rows)}")
        if count is None:
            for t in rows.values():  # a loop, not next() over a generator: a decode step appends per layer
                if isinstance(t, torch.Tensor):
                    count = t.shape[2]
                    break
        if count == 1 and self.holed:  # the hole a one-in-one-out step left: the new row goes there
            for name, value in rows.items():
                buf = self.buffers[name]
                index = self.hole.view(*self.hole.shape, *([1] * (buf.dim() - 2))).expand(
                    *self.hole.shape, 1, *buf.shape[3:])
                buf.scatter_(2, index, value)  # a tensor [B, G, 1, ...] or a scalar
            self.n += 1
            self.holed, self.into_hole = False, True
            return
        self.into_hole = False
        if self.holed:
            self.settle()
        if self.n + count > self.capacity:
            self.reserve(count)
        if count == 1:
            for name, value in rows.items():
                if isinstance(value, torch.Tensor):
                    self.buffers[name].index_copy_(2, self.length, value)
                else:
                    self.buffers[name].index_fill_(2, self.length, value)
            self.length.add_(1)
        else:
            for name, value in rows.items():
                target = self.buffers[name][:, :, self.n : self.n + count]
                if isinstance(value, torch.Tensor):
                    target.copy_(value)
                else:
                    target.fill_(value)
            self.length.fill_(self.n + count)
        self.n += count

    def reserve(self, extra: int) -> None:
        """Make room for ``extra`` more rows: a growing store grows geometrically; a fixed one grows to fit
        (counted in ``growths``: the storage moves, so a captured step must be captured again)."""
        need, cap = self.n + extra, self.capacity
        if need > cap:
            self.settle()
            self.growths += self.fixed
            self.resize(max(need, cap + max(MIN_GROWTH, int(cap * GROWTH))))

    def resize(self, capacity: int) -> None:
        """Reallocate every buffer for ``capacity`` rows (>= ``n``), the live rows copied, the rest ``empty``."""
        self.settle()  # a hole left by vacate() is filled first: the live rows are then [:n]
        capacity = max(capacity, self.n)
        if capacity == self.capacity:
            return
        for name, buf in self.buffers.items():
            new = (buf.new_zeros if self.fixed else buf.new_empty)(*buf.shape[:2], capacity, *buf.shape[3:])
            new[:, :, : self.n].copy_(buf[:, :, : self.n])
            if name in self.empty:
                new[:, :, self.n :].fill_(self.empty[name])
            self.buffers[name] = new
        self._refresh()

    def fix(self, capacity: int, empty: dict[str, Fill]) -> None:
        """Fix the capacity at ``capacity`` rows (>= ``n``), the spare rows holding ``empty`` (a prefilled cache handed on)."""
        self.settle()
        self.fixed = True
        self.empty = dict(empty)
        old = self.capacity
        self.resize(max(capacity, self.n))
        if self.capacity == old:  # not reallocated: the spare rows still hold what a growing store left there
            for buf in self.buffers.values():
                buf[:, :, self.n :].zero_()
            self._clear(self.n, self.capacity)

    def add_field(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, fill: Fill = 0) -> None:
        """A new buffer ``name`` ``[B, G, capacity, *shape]`` beside the others, every row holding ``fill``."""
        like = next(iter(self.buffers.values()))
        self.buffers[name] = torch.full((*like.shape[:3], *shape), fill, dtype=dtype, device=like.device)

    def _clear(self, start: int, stop: int) -> None:
        """Rows ``[start, stop)`` no longer live: their ``empty`` values written."""
        if stop > start:
            for name, value in self.empty.items():
                self.buffers[name][:, :, start:stop].fill_(value)

    def _refresh(self) -> None:
        """The buffers were (re)allocated: where each ``(batch, group)``'s rows start in the flattened buffers
        (``[B, G, 1]`` int64), computed now, so that no step computes it."""
        buf = next(iter(self.buffers.values()), None)
        self.capacity = buf.shape[2] if buf is not None else 0
        if buf is not None:
            B, G, cap = buf.shape[:3]
            self._offsets = torch.arange(B * G, device=buf.device).view(B, G, 1) * cap

    def gather(self, idx: torch.Tensor, names: tuple[str, ...] | None = None) -> dict[str, torch.Tensor]:
        """Copies of the rows ``idx [B, G, k]`` of every buffer (or of ``names``): one ``index_select`` per buffer over
        its rows flattened with ``(batch, group)`` offsets, a few times faster than ``gather`` on small rows."""
        B, G, k = idx.shape
        flat = (idx + self._offsets).view(-1)
        out = {}
        for name, buf in self.buffers.items():
            if names is not None and name not in names:
                continue
            out[name] = buf.view(B * G * buf.shape[2], *buf.shape[3:]).index_select(0, flat).view(B, G, k, *buf.shape[3:])
        return out

    def keep(self, idx: torch.Tensor) -> None:
        """Keep rows ``idx [B, G, k]`` (int64, ascending) as the live rows, in that order: a growing store's buffers
        shrink when they would be mostly empty; a fixed store keeps its storage and clears the rows left."""
        self.settle()
        n, k = self.n, idx.shape[2]
        old = cap = self.capacity
        if not self.fixed and cap > 2 * k + MIN_GROWTH:  # a growing store gives memory back when mostly empty
            cap = k + max(MIN_GROWTH, int(k * GROWTH))
        for name, buf in self.buffers.items():
            rows = gather_rows(buf[:, :, :n], idx)
            new = buf if cap == buf.shape[2] else buf.new_empty(*buf.shape[:2], cap, *buf.shape[3:])
            new[:, :, :k].copy_(rows)
            if name in self.empty:  # the rows past k no longer live (a new buffer: all of them)
                new[:, :, k : n if new is buf else None].fill_(self.empty[name])
            self.buffers[name] = new
        if cap != old:
            self._refresh()
        self.n = k
        self.length.fill_(k)

    def last_index(self) -> torch.Tensor:
        """``[B, G, 1]`` int64 on the device: where the latest single-row append wrote (its own row, for a query)."""
        if self.into_hole:
            return self.hole[..., None]
        B, G = next(iter(self.buffers.values())).shape[:2]
        return (self.length - 1).view(1, 1, 1).expand(B, G, 1)

    def vacate(self, victim: torch.Tensor) -> None:
        """Take row ``victim[b, g]`` (int64 ``[B, G]``) out of every ``(b, g)``, no row moved: the next row appended
        takes its place; until then the live rows are all but that one (:meth:`settle` compacts them if read)."""
        if self.holed:
            self.settle()
        if self.hole is None or self.hole.shape != victim.shape:
            self.hole = victim.clone()
        else:
            self.hole.copy_(victim)
        self.n -= 1
        self.holed = True
        self.ordered = False

    def settle(self) -> None:
        """After :meth:`vacate`, before the live rows are read as ``[:n]``: the last live row moves into the hole (the
        rows are then out of append order). A hot path tests ``self.holed`` before calling this."""
        if not self.holed:
            return
        self.holed = False
        n = self.n + 1
        idx = self.hole[..., None]  # [B, G, 1]
        for buf in self.buffers.values():
            live = buf[:, :, :n]
            last = live[:, :, n - 1 : n].clone()
            index = idx if buf.dim() == 3 else idx.view(*idx.shape, *([1] * (buf.dim() - 3))).expand_as(last)
            live.scatter_(2, index, last)
        self._clear(n - 1, n)
        self.length.sub_(1)
        self.ordered = False

    def ensure_order(self, key: str = "slots") -> None:
        """Sort the live rows by ``key`` (ascending) if :meth:`settle` disturbed their order."""
        self.settle()
        if not self.ordered and self.n:
            order = self.get(key).argsort(dim=2, stable=True)
            for buf in self.buffers.values():
                buf[:, :, : self.n] = gather_rows(buf[:, :, : self.n], order)
        self.ordered = True

    def select_batch(self, index: torch.Tensor) -> None:
        """Keep batch elements ``index`` (beam reordering, batch selection); in place when the batch size stays."""
        self.settle()
        resized = False
        for name, buf in self.buffers.items():
            picked = buf.index_select(0, index)
            if picked.shape == buf.shape:
                buf.copy_(picked)
            else:
                self.buffers[name], resized = picked, True
        if resized:
            self._refresh()

    def repeat_batch(self, repeats: int) -> None:
        """Repeat every batch element ``repeats`` times (``generate``'s expansion for beams)."""
        self.settle()
        self.buffers = {name: buf.repeat_interleave(repeats, dim=0) for name, buf in self.buffers.items()}
        self._refresh()
