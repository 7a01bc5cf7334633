"""A page summary over a layer's archived rows, shared by Quest's index and VestigeKV's paged int8 index.

Pages are ``page_size`` consecutive archived rows (in archive order); per page the summary keeps each key
dimension's minimum and maximum over the page's valid rows, encoded by its user (:class:`PageSummary` is given an
``encode(lo, hi, dtype) -> fields`` function: Quest stores ``[max, min, max |k|]`` in the keys' dtype, exact; the paged
int8 index stores int8 codes with one scale), and an ``empty`` flag (a page of padding rows only: never fetched).

The last page may be open (partial): its running minimum and maximum are kept in fp32 beside the encoded pages,
so a row joining it re-encodes it from exact numbers. One row joining a fixed-capacity summary (a per-step archive,
e.g. Quest's ``rule="eval"``) is written with the same ops whether it opens a page or joins the open one, its page
found from the device count, so that a captured decode step replays it; the host's page count is brought up to
date by the next multi-row index.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvzoo.framework.buffers import RowStore

Encode = Callable[[torch.Tensor, torch.Tensor, torch.dtype], dict[str, torch.Tensor]]  # (lo, hi, keys' dtype)


class PageSummary:
    """The encoded pages ``[B, G, p, ...]`` of a layer's archive, their ``empty`` flags, and the open page's running
    min/max (module docstring). ``fields`` names the encoded buffers (``name -> (trailing shape, dtype)``)."""

    def __init__(self, page_size: int, encode: Encode, capacity: int | None = None) -> None:
        self.page_size = page_size
        self.encode = encode
        self.capacity = capacity  # archived rows a fixed summary is preallocated for (None: it grows)
        self.pages = RowStore()
        self.rows = 0  # archived rows summarised (host)
        self.count: torch.Tensor | None = None  # the same on the device, int64 [1]
        self.open_min: torch.Tensor | None = None  # [B, G, D] fp32, +inf while the open page is empty
        self.open_max: torch.Tensor | None = None  # [B, G, D] fp32, -inf while empty
        self.dtype: torch.dtype | None = None  # the summarised keys' dtype

    @property
    def defined(self) -> bool:
        return bool(self.pages.buffers)

    @property
    def fixed(self) -> bool:
        return self.pages.fixed

    @property
    def live_pages(self) -> int:
        """Pages holding some summarised row (the last may be open)."""
        return -(-self.rows // self.page_size)

    def entries(self) -> int:
        """Pages one scan reads: the live ones, or every page slot of a fixed summary (scanned whole, the unused
        ones empty)."""
        return self.pages.capacity if self.pages.fixed else self.pages.n

    def reading(self, name: str) -> torch.Tensor:
        """What a scan reads of buffer ``name``: every page slot of a fixed summary, else the live pages."""
        return self.pages.reading(name)

    def _define(self, keys: torch.Tensor, fields: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> None:
        B, G, _, D = keys.shape
        pages = -(-self.capacity // self.page_size) if self.capacity is not None else 0
        self.pages.define(B, G, {**fields, "empty": ((), torch.bool)}, keys.device, capacity=pages,
                          fixed=self.capacity is not None, empty={"empty": True})
        self.count = torch.zeros(1, dtype=torch.long, device=keys.device)
        self.dtype = keys.dtype
        self.open_min = torch.full((B, G, D), float("inf"), device=keys.device)
        self.open_max = torch.full((B, G, D), float("-inf"), device=keys.device)

    def add(self, keys: torch.Tensor, valid: torch.Tensor,
            fields: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> None:
        """Summarise archived rows ``keys [B, G, k, D]`` (``valid`` False: padding, which never widens a page) as
        they join the end of the archive. ``fields`` (the encoded buffers' shapes and dtypes) define the summary
        on its first call."""
        B, G, k, D = keys.shape
        if k == 0:
            return
        if not self.defined:
            self._define(keys, fields)
        x = keys.float()
        lo = x.masked_fill(~valid[..., None], float("inf"))
        hi = x.masked_fill(~valid[..., None], float("-inf"))
        size = self.page_size
        if k == 1 and self.pages.fixed and self.rows < self.pages.capacity * size:
            self._add_one(lo[:, :, 0], hi[:, :, 0])
            return
        live = self.live_pages
        if self.pages.n != live:  # after single rows (_add_one leaves the host's page count)
            self.pages.n = live
            self.pages.length.fill_(live)
        filled = self.rows % size  # rows already in the open page
        pages = -(-(filled + k) // size)
        pad = pages * size - filled - k
        lo = torch.cat([lo.new_full((B, G, filled, D), float("inf")), lo, lo.new_full((B, G, pad, D), float("inf"))], 2)
        hi = torch.cat([hi.new_full((B, G, filled, D), float("-inf")), hi,
                        hi.new_full((B, G, pad, D), float("-inf"))], 2)
        lo = lo.view(B, G, pages, size, D).amin(3)
        hi = hi.view(B, G, pages, size, D).amax(3)
        if filled:  # the open page's earlier rows
            lo[:, :, 0] = torch.minimum(lo[:, :, 0], self.open_min)
            hi[:, :, 0] = torch.maximum(hi[:, :, 0], self.open_max)
        encoded = self.encode(lo, hi, self.dtype)
        encoded["empty"] = torch.isinf(lo).all(-1) & torch.isinf(hi).all(-1)
        if filled:  # rewrite the open page in place, append the rest
            for name, value in encoded.items():
                self.pages.get(name)[:, :, -1] = value[:, :, 0]
            encoded = {name: value[:, :, 1:] for name, value in encoded.items()}
        if next(iter(encoded.values())).shape[2]:
            self.pages.append(encoded)
        self.open_min.copy_(lo[:, :, -1])
        self.open_max.copy_(hi[:, :, -1])
        self.rows += k
        self.count.fill_(self.rows)

    def _add_one(self, lo: torch.Tensor, hi: torch.Tensor) -> None:
        """One row (``[B, G, D]``) joins a fixed summary, the same ops whether it opens a page or joins the open
        one (its page found from the device count); the host's page count is left as it is (a replayed CUDA graph
        carries only host numbers that move linearly) and brought up to date by the next multi-row add."""
        size = self.page_size
        page = torch.div(self.count, size, rounding_mode="floor")  # [1], on the device
        opens = (self.count % size == 0).view(1, 1, 1)
        self.open_min.copy_(torch.where(opens, lo, torch.minimum(self.open_min, lo)))
        self.open_max.copy_(torch.where(opens, hi, torch.maximum(self.open_max, hi)))
        encoded = self.encode(self.open_min[:, :, None], self.open_max[:, :, None], self.dtype)
        encoded["empty"] = (torch.isinf(self.open_min).all(-1) & torch.isinf(self.open_max).all(-1))[:, :, None]
        for name, value in encoded.items():
            self.pages.buffers[name].index_copy_(2, page, value)
        self.count.add_(1)
        self.rows += 1
        self.pages.length.copy_(torch.div(self.count + (size - 1), size, rounding_mode="floor"))

    def room_for_one(self) -> bool:
        """Before one row is summarised by a single op on the device (e.g. Quest's ``quest_page_add``, which writes
        the page at ``count // page_size``): whether it can be -- the summary defined and, fixed, not full -- with a
        growing summary given a page slot first when the row opens one. The op's caller then calls
        :meth:`one_added`."""
        pages, size = self.pages, self.page_size
        if not pages.buffers:  # not defined
            return False
        if pages.fixed:
            return self.rows < pages.capacity * size
        if self.rows % size == 0:  # the row opens a page: a slot for it (the store grows geometrically)
            pages.n = self.live_pages
            pages.reserve(1)
        return True

    def one_added(self) -> None:
        """The host's side of a row a device op summarised (after :meth:`room_for_one`): the row count, and a growing
        summary's page count (a fixed one's is brought up to date by the next multi-row add)."""
        self.rows += 1
        if not self.pages.fixed:
            self.pages.n = self.live_pages

    def select_batch(self, index: torch.Tensor) -> None:
        if self.defined:
            self.pages.select_batch(index)
            self.open_min = self.open_min.index_select(0, index)
            self.open_max = self.open_max.index_select(0, index)

    def repeat_batch(self, repeats: int) -> None:
        if self.defined:
            self.pages.repeat_batch(repeats)
            self.open_min = self.open_min.repeat_interleave(repeats, dim=0)
            self.open_max = self.open_max.repeat_interleave(repeats, dim=0)
