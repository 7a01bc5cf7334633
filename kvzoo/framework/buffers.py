"""Growable row buffers: named tensors that share a row axis, preallocated, growing geometrically.

The storage under a layer's tiers (``framework/store.py``) and under the retrievers' indexes
(``policies/``); torch only. A :class:`RowStore` holds named tensors ``[B, G, capacity, ...]``
(keys, values, slots, valid flags, per-row statistics) of which the first ``n`` rows along dim 2
are live. Appending writes into the
spare capacity (no new tensor per step); the capacity grows by a quarter (at least ``MIN_GROWTH``
rows) when it runs out, so a decode of ``T`` steps costs ``O(T)`` row copies in all, and it shrinks
when an eviction leaves it mostly empty, so that compressing really frees memory. Two ways rows
leave:

* :meth:`keep` -- keep the rows named by sorted indices, in that order (a compression event);
* :meth:`remove_one` -- take out one row per ``(batch, group)`` and move the last row into the
  hole (the per-step "one in, one out" of StreamingLLM and H2O): ``O(1)`` rows move instead of
  the whole tier. The rows are then no longer in slot order; :meth:`ensure_order` sorts them back
  (one gather) before anything that reads order (a selector, a multi-token forward).

It knows no policy, no model and no cache: tensors in, tensors out.
"""

from __future__ import annotations

import torch

MIN_GROWTH = 64  # rows: the smallest step by which a store grows
GROWTH = 0.25  # grow by a quarter of the current capacity (amortised O(1) copies per appended row)


def gather_rows(t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``t[b, g, idx[b, g, i], ...]`` for ``t [B, G, n, ...]`` and ``idx [B, G, k]``."""
    if t.dim() == 3:
        return t.gather(2, idx)
    return t.gather(2, idx.view(*idx.shape, *([1] * (t.dim() - 3))).expand(*idx.shape, *t.shape[3:]))


class RowStore:
    """Named tensors ``[B, G, capacity, ...]`` sharing a row axis; rows ``[:n]`` are live."""

    def __init__(self) -> None:
        self.buffers: dict[str, torch.Tensor] = {}
        self.n = 0  # live rows
        self.ordered = True  # live rows are in the order they were appended (slot order)

    # --- reading -----------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return next(iter(self.buffers.values())).shape[2] if self.buffers else 0

    def __contains__(self, name: str) -> bool:
        return name in self.buffers

    def get(self, name: str) -> torch.Tensor:
        """The live rows of ``name``: a view ``[B, G, n, ...]`` of the buffer (no copy)."""
        return self.buffers[name][:, :, : self.n]

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every buffer's live rows ``[B, G, n, ...]`` (views); an empty dict when no row is live."""
        return {name: self.get(name) for name in self.buffers} if self.n else {}

    def nbytes(self, names: tuple[str, ...] | None = None) -> int:
        """Bytes of the live rows of ``names`` (all buffers when None)."""
        total = 0
        for name, buf in self.buffers.items():
            if names is None or name in names:
                total += buf[:, :, : self.n].numel() * buf.element_size()
        return total

    def allocated_bytes(self) -> int:
        return sum(buf.numel() * buf.element_size() for buf in self.buffers.values())

    # --- writing -----------------------------------------------------------------------------
    def define(
        self,
        batch: int,
        groups: int,
        fields: dict[str, tuple[tuple[int, ...], torch.dtype]],
        device: torch.device,
        capacity: int = 0,
    ) -> None:
        """Create the buffers: ``name -> (trailing shape, dtype)``, each ``[batch, groups, capacity, *shape]``."""
        self.buffers = {
            name: torch.empty(batch, groups, capacity, *shape, dtype=dtype, device=device)
            for name, (shape, dtype) in fields.items()
        }
        self.n = 0
        self.ordered = True

    def append(self, rows: dict[str, torch.Tensor | bool | int | float], count: int | None = None) -> None:
        """Write ``count`` rows after the live rows: per buffer a tensor ``[B, G, count, ...]`` or a scalar.

        Every buffer must be named. A scalar fills its rows without creating a tensor.
        """
        if set(rows) != set(self.buffers):
            raise ValueError(f"append needs every buffer {sorted(self.buffers)}, got {sorted(rows)}")
        if count is None:
            count = next(t.shape[2] for t in rows.values() if isinstance(t, torch.Tensor))
        self.reserve(count)
        for name, value in rows.items():
            target = self.buffers[name][:, :, self.n : self.n + count]
            if isinstance(value, torch.Tensor):
                target.copy_(value)
            else:
                target.fill_(value)
        self.n += count

    def reserve(self, extra: int) -> None:
        """Make room for ``extra`` more rows (grow geometrically when the capacity runs out)."""
        need = self.n + extra
        cap = self.capacity
        if need > cap:
            self._resize(max(need, cap + max(MIN_GROWTH, int(cap * GROWTH))))

    def _resize(self, capacity: int) -> None:
        for name, buf in self.buffers.items():
            new = buf.new_empty(*buf.shape[:2], capacity, *buf.shape[3:])
            new[:, :, : self.n].copy_(buf[:, :, : self.n])
            self.buffers[name] = new

    def _shrunk_capacity(self, n: int) -> int:
        """After an eviction: give memory back when the store would be mostly empty."""
        cap = self.capacity
        if cap > 2 * n + MIN_GROWTH:
            return n + max(MIN_GROWTH, int(n * GROWTH))
        return cap

    def complement(self, idx: torch.Tensor) -> torch.Tensor:
        """Indices ``[B, G, n - k]`` (ascending) of the live rows that ``idx [B, G, k]`` does not name."""
        n, k = self.n, idx.shape[2]
        kept = torch.zeros(*idx.shape[:2], n, dtype=torch.bool, device=idx.device).scatter_(2, idx, True)
        # a stable sort of the 0/1 mask puts the rows not kept first, in order
        return torch.sort(kept.to(torch.uint8), dim=2, stable=True).indices[:, :, : n - k]

    def gather(self, idx: torch.Tensor, names: tuple[str, ...] | None = None) -> dict[str, torch.Tensor]:
        """Copies of the live rows ``idx [B, G, k]`` of every buffer (or of ``names``).

        One ``index_select`` per buffer over its rows flattened with ``(batch, group)`` offsets
        (the buffers are contiguous), which is a few times faster than ``gather`` on small rows.
        """
        B, G, k = idx.shape
        flat = None
        out = {}
        for name, buf in self.buffers.items():
            if names is not None and name not in names:
                continue
            if flat is None:
                cap = buf.shape[2]
                offsets = torch.arange(B * G, device=idx.device).view(B, G, 1) * cap
                flat = (idx + offsets).view(-1)
            out[name] = buf.view(B * G * buf.shape[2], *buf.shape[3:]).index_select(0, flat).view(B, G, k, *buf.shape[3:])
        return out

    def keep(self, idx: torch.Tensor) -> None:
        """Keep rows ``idx [B, G, k]`` (int64, ascending) as the new live rows, in that order.

        The buffers shrink when they would be mostly empty (see :meth:`_shrunk_capacity`).
        """
        n, k = self.n, idx.shape[2]
        cap = self._shrunk_capacity(k)
        for name, buf in self.buffers.items():
            rows = gather_rows(buf[:, :, :n], idx)
            new = buf if cap == buf.shape[2] else buf.new_empty(*buf.shape[:2], cap, *buf.shape[3:])
            new[:, :, :k].copy_(rows)
            self.buffers[name] = new
        self.n = k

    def remove_one(self, victim: torch.Tensor) -> None:
        """Take row ``victim[b, g]`` out of every ``(b, g)``; the last live row moves into its place.

        ``victim`` is int64 ``[B, G]`` (read the row first with :meth:`gather` to keep it). ``O(1)``
        rows move; the live rows are no longer in append order afterwards.
        """
        n = self.n
        idx = victim[..., None]  # [B, G, 1]
        for buf in self.buffers.values():
            live = buf[:, :, :n]
            last = live[:, :, n - 1 : n].clone()
            index = idx if buf.dim() == 3 else idx.view(*idx.shape, *([1] * (buf.dim() - 3))).expand_as(last)
            live.scatter_(2, index, last)
        self.n = n - 1
        self.ordered = False

    def ensure_order(self, key: str = "slots") -> None:
        """Sort the live rows by ``key`` (ascending) if :meth:`remove_one` disturbed their order."""
        if not self.ordered and self.n:
            order = self.get(key).argsort(dim=2, stable=True)
            for buf in self.buffers.values():
                buf[:, :, : self.n] = gather_rows(buf[:, :, : self.n], order)
        self.ordered = True

    def select_batch(self, index: torch.Tensor) -> None:
        """Keep batch elements ``index`` (beam reordering, batch selection)."""
        self.buffers = {name: buf.index_select(0, index) for name, buf in self.buffers.items()}

    def repeat_batch(self, repeats: int) -> None:
        """Repeat every batch element ``repeats`` times (``generate``'s expansion for beams)."""
        self.buffers = {name: buf.repeat_interleave(repeats, dim=0) for name, buf in self.buffers.items()}
