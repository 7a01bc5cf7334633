"""The decode-attention op's inputs and outputs: :class:`Rows` (one source of rows), :class:`Attended` (a part of a
step), and the input checks every implementation runs first (the semantics: the package's docstring).

What a query head may read (:func:`group_readable`, :func:`readable`) is part of the specification: the reference
and the SDPA form share these two functions, the kernels and the native op compute the same from the same inputs.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)
MAX_SPLITS = 65_535  # CUDA's limit on a grid's second dimension


@dataclass
class Rows:
    """One source of rows for a decode step (the package's docstring gives the semantics)."""

    keys: torch.Tensor  # [B, G, N, D]; a preallocated pool may be passed whole; last dim contiguous
    values: torch.Tensor | None = None  # [B, G, N, Dv]; None: MLA absorbed, value = keys[..., :value_width]
    value_width: int | None = None  # Dv when values is None
    valid: torch.Tensor | None = None  # [B, G, N'] bool (N' = N, or K with indices); None: all
    length: torch.Tensor | None = None  # [B] int32/int64 on the query's device; None: all N' positions
    indices: torch.Tensor | None = None  # [B, G, K] int32/int64: gathered form
    head_valid: torch.Tensor | None = None  # [B, H, N'] bool per query head; None: all
    # [B, G, N] bool, a flag per row of the pool (read through ``indices`` in the gathered form): a layer's padding
    # flags passed once instead of gathered per step; it joins ``valid`` (a position is readable only if both allow)
    pool_valid: torch.Tensor | None = None


# validation (every implementation checks its inputs here first)


@dataclass(frozen=True)
class _Source:
    """A validated source: the :class:`Rows` and the numbers both implementations need."""

    rows: Rows
    groups: int
    pool: int  # N: rows in the pool
    positions: int  # N': N, or K in the gathered form
    value_width: int


def _shape(t: torch.Tensor) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def _on(what: str, t: torch.Tensor, device: torch.device) -> None:
    if t.device != device:
        raise ValueError(f"{what} is on {t.device}, the query on {device}: put them on one device")


def _check_flag(what: str, t, shape: tuple[int, ...], device: torch.device) -> None:
    if t is None:
        return
    if not isinstance(t, torch.Tensor) or t.dtype != torch.bool:
        got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{what} must be a bool tensor, got {got}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{what} must have shape {list(shape)}, got {_shape(t)}")
    _on(what, t, device)


def _validate(query: torch.Tensor, sources, scaling, splits, fold: bool = True) -> list[_Source]:
    """Every input checked (a ValueError says what was wrong and what is valid); ``fold``: :func:`_fold`. Once per
    decode step and layer: the checks that pass call few functions (a message is built only when a check fails)."""
    if not (isinstance(query, torch.Tensor) and query.dim() == 3 and query.dtype in FLOAT_DTYPES
            and isinstance(scaling, (int, float)) and math.isfinite(scaling) and splits is None
            and isinstance(sources, (list, tuple)) and sources):
        _check_call(query, sources, scaling, splits)  # raises, naming what is wrong
    out: list[_Source] = []
    for i, src in enumerate(sources):
        if not isinstance(src, Rows):
            raise ValueError("sources must be a non-empty list of Rows")
        out.append(_check_source(f"sources[{i}]", src, query, out[0].value_width if out else None))
    return _fold(out) if fold else out


def _fold(checked: list[_Source]) -> list[_Source]:
    """The checked sources with their pool flags folded into ``valid`` (what every form but the native op reads)."""
    for i, c in enumerate(checked):
        if c.rows.pool_valid is not None:
            checked[i] = dataclasses.replace(c, rows=_fold_pool_valid(c.rows, c.pool))
    return checked


def _check_call(query: torch.Tensor, sources, scaling, splits) -> None:
    if not isinstance(query, torch.Tensor) or query.dim() != 3:
        got = _shape(query) if isinstance(query, torch.Tensor) else type(query).__name__
        raise ValueError(f"query must be a [B, H, D] tensor, got {got}")
    if query.dtype not in FLOAT_DTYPES:
        raise ValueError(f"query must be float16, bfloat16 or float32, got {query.dtype}")
    if not isinstance(scaling, (int, float)) or not math.isfinite(scaling):
        raise ValueError(f"scaling must be a finite number, got {scaling!r}")
    if splits is not None and (isinstance(splits, bool) or not isinstance(splits, int)
                               or not 1 <= splits <= MAX_SPLITS):
        raise ValueError(f"splits must be None or an int in [1, {MAX_SPLITS}], got {splits!r}")
    if not isinstance(sources, (list, tuple)) or not sources:  # (a source that is no Rows: _validate says so)
        raise ValueError("sources must be a non-empty list of Rows")


def _check_keys(name: str, k, query: torch.Tensor) -> None:
    if not isinstance(k, torch.Tensor) or k.dim() != 4:
        got = _shape(k) if isinstance(k, torch.Tensor) else type(k).__name__
        raise ValueError(f"{name}.keys must be a [B, G, N, D] tensor, got {got}")
    if k.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name}.keys must be float16, bfloat16 or float32, got {k.dtype}")
    if k.device != query.device:
        _on(f"{name}.keys", k, query.device)
    B, H, D = query.shape
    Bk, G, N, Dk = k.shape
    if Bk != B or Dk != D:
        raise ValueError(f"{name}.keys {_shape(k)} must be [B={B}, G, N, D={D}] for query {_shape(query)}")
    if G < 1 or H % G:
        raise ValueError(f"{name}.keys has G={G} KV groups; the query's H={H} heads must be a multiple of it")
    if k.stride(-1) != 1 and D > 1:
        raise ValueError(f"{name}.keys must have a contiguous last dimension (stride 1), got strides {k.stride()}")


def _value_width(name: str, src: Rows, query: torch.Tensor) -> int:
    """The checked values' width ``Dv``."""
    B, _, D = query.shape
    k = src.keys
    if src.values is None:
        width = src.value_width
        if isinstance(width, bool) or not isinstance(width, int) or not 1 <= width <= D:
            raise ValueError(f"{name} has values=None (MLA absorbed form): value_width must be an int in "
                             f"[1, D={D}], got {width!r}")
        return width
    v = src.values
    _, G, N, _ = k.shape
    if not isinstance(v, torch.Tensor) or v.dim() != 4 or tuple(v.shape[:3]) != (B, G, N):
        got = _shape(v) if isinstance(v, torch.Tensor) else type(v).__name__
        raise ValueError(f"{name}.values must be [B={B}, G={G}, N={N}, Dv], got {got}")
    if v.dtype != k.dtype:
        raise ValueError(f"{name}.values must have the keys' dtype {k.dtype}, got {v.dtype}")
    if v.device != query.device:
        _on(f"{name}.values", v, query.device)
    if v.stride(-1) != 1 and v.shape[-1] > 1:
        raise ValueError(f"{name}.values must have a contiguous last dimension (stride 1), "
                         f"got strides {v.stride()}")
    width = v.shape[-1]
    if width < 1:
        raise ValueError(f"{name}.values has Dv=0; the value width must be >= 1")
    if src.value_width is not None and src.value_width != width:
        raise ValueError(f"{name}.value_width={src.value_width!r} disagrees with values' Dv={width} "
                         "(value_width is only for values=None)")
    return width


def _check_source(name: str, src: Rows, query: torch.Tensor, first_width: int | None) -> _Source:
    B, H, D = query.shape
    device = query.device
    k, v = src.keys, src.values
    # the usual source, checked in place: keys [B, G, N, D] and values [B, G, N, Dv] in one float dtype on the
    # query's device, last dims contiguous; anything else goes through the checks that name what is wrong
    if (isinstance(k, torch.Tensor) and k.dim() == 4 and k.dtype in FLOAT_DTYPES and k.device == device
            and k.shape[0] == B and k.shape[3] == D and k.shape[1] >= 1 and H % k.shape[1] == 0
            and (k.stride(3) == 1 or D == 1) and isinstance(v, torch.Tensor) and v.dim() == 4
            and v.shape[:3] == k.shape[:3] and v.dtype == k.dtype and v.device == device and v.shape[3] >= 1
            and (v.stride(3) == 1 or v.shape[3] == 1) and (src.value_width is None or src.value_width == v.shape[3])):
        width = v.shape[3]
    else:
        _check_keys(name, k, query)
        width = _value_width(name, src, query)
    _, G, N, _ = k.shape
    if first_width is not None and width != first_width:
        raise ValueError(f"{name} has value width {width}, sources[0] {first_width}: all sources must share Dv")
    positions = N
    if src.indices is not None:
        idx = src.indices
        if not isinstance(idx, torch.Tensor) or idx.dtype not in INDEX_DTYPES:
            got = idx.dtype if isinstance(idx, torch.Tensor) else type(idx).__name__
            raise ValueError(f"{name}.indices must be an int32 or int64 tensor, got {got}")
        if idx.dim() != 3 or tuple(idx.shape[:2]) != (B, G):
            raise ValueError(f"{name}.indices must have shape [B={B}, G={G}, K], got {_shape(idx)}")
        if idx.device != device:
            _on(f"{name}.indices", idx, device)
        positions = idx.shape[2]
    if src.length is not None:
        ln = src.length
        if not isinstance(ln, torch.Tensor) or ln.dtype not in INDEX_DTYPES or tuple(ln.shape) != (B,):
            got = f"{ln.dtype} {_shape(ln)}" if isinstance(ln, torch.Tensor) else type(ln).__name__
            raise ValueError(f"{name}.length must be an int32 or int64 tensor of shape [B={B}], got {got}")
        if ln.device != device:
            _on(f"{name}.length (a tensor on the query's device)", ln, device)
    for what, flag, shape in ((".valid", src.valid, (B, G, positions)), (".head_valid", src.head_valid,
                              (B, H, positions)), (".pool_valid", src.pool_valid, (B, G, N))):
        if flag is not None and not (isinstance(flag, torch.Tensor) and flag.dtype == torch.bool
                                     and flag.shape == shape and flag.device == device):
            _check_flag(name + what, flag, shape, device)  # raises, naming what is wrong
    return _Source(src, G, N, positions, width)


def _fold_pool_valid(src: Rows, pool: int) -> Rows:
    """``src`` with its pool flags folded into ``valid`` (one flag per position: the form every implementation but
    the native one reads)."""
    flags = src.pool_valid
    if src.indices is not None:
        flags = flags.gather(2, src.indices.to(torch.int64).clamp(0, max(pool - 1, 0))) if pool else \
            torch.zeros(src.indices.shape, dtype=torch.bool, device=flags.device)
    valid = flags if src.valid is None else src.valid & flags
    return dataclasses.replace(src, valid=valid, pool_valid=None)


@dataclass
class Attended:
    """One part of a step (``attend``): ``out [B, H, Dv]`` normalised over this part's readable rows (fp32, or the
    query's dtype), ``lse [B, H]`` fp32 (``-inf``: none readable), ``best [B, H]`` the best scaled score (s*), ``mass``
    per source ``[B, H, N']`` fp32: each position's probability within this part (H2O's accumulator)."""

    out: torch.Tensor | None
    lse: torch.Tensor | None = None
    best: torch.Tensor | None = None
    mass: list[torch.Tensor] | None = None
    # a deferred part (attend(..., defer=True)) of the PyTorch forms: each source's masked scores [B, H, N'] fp32 and
    # the sources, which a later attend(..., prior=part) joins into one softmax with its own (the reference reads the
    # sources again, the SDPA form joins the scores); a kernel's or the native op's part has neither: it is merged by
    # its log-sum-exp
    scores: list[torch.Tensor] | None = None
    sources: list | None = None


def _group_readable(query: torch.Tensor, s: _Source) -> torch.Tensor:
    """Bool ``[B, G, N']``: the positions within length, in the pool and valid (before ``head_valid``)."""
    B = query.shape[0]
    src = s.rows
    if src.length is None and src.indices is None and src.valid is not None:
        return src.valid  # the common case: the flags alone
    pos = torch.arange(s.positions, device=query.device)
    allowed = torch.ones(B, s.groups, s.positions, dtype=torch.bool, device=query.device)
    if src.length is not None:
        allowed = allowed & (pos[None, None, :] < src.length.to(torch.int64)[:, None, None])
    if src.indices is not None:
        allowed = allowed & (src.indices >= 0) & (src.indices < s.pool)
    if src.valid is not None:
        allowed = allowed & src.valid
    return allowed


def _readable(group_readable: torch.Tensor, s: _Source, heads: int) -> torch.Tensor:
    """Bool ``[B, H, N']``: which positions each query head may read."""
    allowed = group_readable.repeat_interleave(heads // s.groups, dim=1)
    if s.rows.head_valid is not None:
        allowed = allowed & s.rows.head_valid
    return allowed

