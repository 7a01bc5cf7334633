"""Every per-sequence or row tensor an op takes may be a view: contiguous, strided (every other element of a wider
tensor), or stride 0 (one value expanded over the batch, as a fixed-capacity layer passes its live count). The Triton
decode attention and index scans against their PyTorch references on each kind, in the interpreter."""

from __future__ import annotations

import itertools

import pytest
import torch

from kvzoo.kernels.decode_attention import Rows, decode_attention_reference, decode_attention_triton
from kvzoo.kernels.index_scan import (
    index_scan_reduce_reference,
    index_scan_reduce_triton,
    index_scan_reference,
    index_scan_triton,
)
from tests.interpreter.test_decode_attention import FORMS, SCALE, _close
from tests.interpreter.test_index_scan import _relative

LENGTHS = ("none", "contiguous", "strided", "stride0")
LAYOUTS = ("contiguous", "strided")


def _length(kind: str, B: int, n: int, g: torch.Generator) -> torch.Tensor | None:
    """A per-sequence count ``[B]`` of the named kind (each sequence its own value unless stride 0)."""
    values = torch.randint(n // 3, n + 1, (2 * B,), generator=g)
    if kind == "none":
        return None
    if kind == "contiguous":
        return values[:B].clone()
    if kind == "strided":
        return values[::2]  # stride 2
    out = values[:1].expand(B)  # stride 0: one count for every sequence
    assert out.stride(0) == 0
    return out


def _view(t: torch.Tensor, layout: str, dim: int) -> torch.Tensor:
    """``t`` itself, or the same values as every other slice of a tensor twice as wide along ``dim``."""
    if layout == "contiguous":
        return t
    shape = list(t.shape)
    shape[dim] *= 2
    wide = torch.full(shape, float("nan") if t.is_floating_point() else -1, dtype=t.dtype)  # never read
    index = [slice(None)] * t.dim()
    index[dim] = slice(None, None, 2)
    wide[tuple(index)] = t
    return wide[tuple(index)]


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("B", [2, 3])
@pytest.mark.parametrize("length_kind,rows_layout,gathered", list(itertools.product(LENGTHS, LAYOUTS, (False, True))))
def test_decode_attention_reads_every_view_as_the_reference_does(form, B, length_kind, rows_layout, gathered):
    G, hpg, D, Dv, separate = FORMS[form]
    N = 70
    g = torch.Generator().manual_seed(hash((form, B, length_kind, rows_layout, gathered)) % 2**31)
    query = _view(torch.randn(B, G * hpg, D, generator=g), rows_layout, 1)
    keys = _view(torch.randn(B, G, N, D, generator=g), rows_layout, 2)
    values = _view(torch.randn(B, G, N, Dv, generator=g), rows_layout, 2) if separate else None
    positions = N
    indices = None
    if gathered:
        positions = 50
        indices = _view(torch.stack([torch.randperm(N, generator=g)[:positions] for _ in range(B * G)])
                        .view(B, G, positions), rows_layout, 2)
    src = Rows(keys, values, value_width=None if separate else Dv, indices=indices,
               length=_length(length_kind, B, positions, g))
    _close(decode_attention_triton(query, [src], SCALE), decode_attention_reference(query, [src], SCALE),
           torch.float32)


@pytest.mark.parametrize("reduce", [False, True])
@pytest.mark.parametrize("B", [2, 3])
@pytest.mark.parametrize("length_kind,layout", list(itertools.product(LENGTHS, LAYOUTS)))
def test_index_scans_read_every_view_as_the_reference_does(reduce, B, length_kind, layout):
    G, hq, m, W = 2, 3, 70, 33
    g = torch.Generator().manual_seed(hash((reduce, B, length_kind, layout)) % 2**31)
    query = _view(torch.randn(B, G, hq, W, generator=g), layout, 2)
    entries = _view(torch.randn(B, G, m, W, generator=g), layout, 2)
    length = _length(length_kind, B, m, g)
    if reduce:
        threshold = _view(torch.randn(B, G, hq, generator=g), layout, 2)
        got = index_scan_reduce_triton(query, entries, SCALE, threshold, length=length)
        want = index_scan_reduce_reference(query, entries, SCALE, threshold, length=length)
    else:
        got = index_scan_triton(query, entries, SCALE, length=length)
        want = index_scan_reference(query, entries, SCALE, length=length)
    assert _relative(got, want) <= 1e-5
