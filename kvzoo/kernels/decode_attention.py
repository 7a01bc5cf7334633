"""Gathered split-K decode attention over several row sources, one softmax (reference and Triton kernels).

One decode step: one query per sequence, ``query [B, H, D]``, reads rows from one or more
:class:`Rows` sources (the attended pool, the rows a retriever fetched, ...). Every readable row of
every source joins **one** softmax; the result is the output ``[B, H, Dv]`` (the query's dtype) and
the natural-log log-sum-exp ``[B, H]`` (fp32) of the scaled scores over all those rows.

A source holds ``keys [B, G, N, D]`` (``G`` KV groups, ``H % G == 0``: query head ``h`` reads group
``h // (H // G)``) and its values in one of two forms:

* GQA: ``values [B, G, N, Dv]``, separate rows;
* MLA absorbed: ``values=None`` and ``value_width=Dv``: the value of a row is its first ``Dv``
  dims (DeepSeek / Kimi latent rows of 512 + 64: the key is the whole 576-dim row, the value its
  512-dim latent). The kernel loads such a row once for both products.

Which rows a query head reads (a *readable* row) is the conjunction of:

* ``length [B]`` (a device tensor, so a launch can be graph-captured): positions ``[0, length[b])``
  only (``None``: every position). A position is a row index ``n`` of the pool, or in the gathered
  form an entry ``i`` of ``indices``;
* ``indices [B, G, K]`` (gathered form): position ``i`` is the row ``keys[b, g, indices[b, g, i]]``;
  a duplicate index is read twice, like a gather. An index outside ``[0, N)`` makes its entry
  unreadable (so ``-1`` may pad; neither implementation reads outside the pool);
* ``valid [B, G, N']`` (``N' = N``, or ``K`` in the gathered form), per position;
* ``head_valid [B, H, N']`` per query head and position (Quest picks pages per head).

What a row that is not readable by any head of its group holds never matters (a preallocated pool
may hold NaN past ``length`` or in invalid rows). A preallocated pool may be passed whole (any
strides, last dim contiguous) with ``length`` marking its filled prefix.

Scores are ``scaling * <q, k>``, with the query first rounded to the rows' dtype (as
:func:`kvzoo.kernels.attention.row_scores` does) and the products accumulated in fp32; the softmax
and the output's accumulation are fp32 and the output is cast to the query's dtype. A ``(b, h)``
with no readable row gets ``out = 0`` and ``lse = -inf`` (never NaN). With one source and no
``length`` / ``indices`` / ``head_valid`` this is plain softmax attention of one query over the rows.

Three implementations (``attend(..., impl=...)``; :func:`kvzoo.kernels.dispatch.decode_impl` picks one): the
**reference** (the specification, fp32 math), **sdpa** (torch's fused ``scaled_dot_product_attention`` for one
plain source; per-source scores in the rows' dtype and one fp32 softmax otherwise) and **triton** (below).
``tests/test_decode_attention_reference.py`` and ``tests/interpreter/test_decode_attention.py`` hold the
others to the reference on one list of cases.

The Triton path (CUDA tensors, or CPU under ``TRITON_INTERPRET=1``) is split-K: per source one
program per ``(batch x KV group, split)`` holds *all* the query heads of its group (``BLOCK_H =
max(16, next_pow2(H / G))``, masked), so each row is loaded once per group, and runs an online
softmax over its share of the positions in ``BLOCK_N`` tiles, with the scale folded into ``exp2``.
Each split with positions writes a partial ``(out, lse)`` (and, asked for ``best``, its maximum score:
s* with no second read of the rows); a split with none writes nothing. Then one merge kernel per source
combines its splits exactly (log-sum-exp weights) in one pass -- every split's lse in one tile, their
outputs in one load -- and folds in what came before: the previous source's result, or a part computed
earlier (``attend(..., prior=part)``: the runtime's tier, deferred for its best score, then the fetched
rows). ``splits`` sets the splits per source (any count gives the same result up to rounding; more
splits than tiles leaves some empty); ``None`` fills one wave of the chip, ``SMs x ctas_per_sm``
programs, at most one split per tile (:func:`default_splits`). Block sizes, warps, stages and the
occupancy they give come from :func:`split_config` / :func:`merge_config`, shared by the launcher and
:func:`shipped_configs` (the sm_90 compile gate, ``tests/test_compile_gate.py``, checks the compiled code
against them). Triton is imported only when its path runs.

Kernel details: the split of a sequence is computed in the program from ``length`` (so a captured
launch follows the true length: the positions ``[0, length)`` are cut into ``splits`` runs of whole
tiles; the merge recomputes which splits hold positions). ``valid`` and ``head_valid`` are packed on the
host into ``ceil(hpg / 32)`` int32 words per position (:func:`_flag_words`; the kernel reads exactly
those). A tile's indices and flag words are loaded one iteration ahead and folded into one row number
per position (-1: past ``length``, outside the pool or readable by no head of the group: never loaded),
so no row load waits on a load of its own iteration and two row tiles are in flight in every variant.
The query is cast to the rows' dtype for ``tl.dot`` (bf16/fp16 products on ``mma.sync``, fp32
accumulation; fp32 rows use ``input_precision="ieee"``), the probabilities to the values' dtype for the
second product. When the pools are 16-byte aligned with row strides that are multiples of 16 elements
(the shipped shapes), the kernel tells the compiler so (``ALIGNED``), which vectorises the loads into
asynchronous copies.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from kvzoo.kernels import dispatch

LOG2E = 1.4426950408889634
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)
DEFAULT_SMS = 132  # H100 SXM / H200: the splits heuristic's SM count when the device has none to report
MAX_SPLITS = 65_535  # CUDA's limit on a grid's second dimension
# Most fp32 elements of one block of rows the reference upcasts at once (its extra memory).
REFERENCE_ROW_BLOCK_ELEMENTS = 1 << 22


@dataclass
class Rows:
    """One source of rows for a decode step (see the module docstring for the semantics)."""

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


# ----------------------------------------------------------------------------------------------------
# validation (shared by both paths)
# ----------------------------------------------------------------------------------------------------


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
    if not isinstance(sources, (list, tuple)) or not sources or not all(isinstance(s, Rows) for s in sources):
        raise ValueError("sources must be a non-empty list of Rows")
    B, H, D = query.shape
    device = query.device
    out: list[_Source] = []
    for i, src in enumerate(sources):
        name = f"sources[{i}]"
        k = src.keys
        if not isinstance(k, torch.Tensor) or k.dim() != 4:
            got = _shape(k) if isinstance(k, torch.Tensor) else type(k).__name__
            raise ValueError(f"{name}.keys must be a [B, G, N, D] tensor, got {got}")
        if k.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{name}.keys must be float16, bfloat16 or float32, got {k.dtype}")
        _on(f"{name}.keys", k, device)
        Bk, G, N, Dk = k.shape
        if Bk != B or Dk != D:
            raise ValueError(f"{name}.keys {_shape(k)} must be [B={B}, G, N, D={D}] for query "
                             f"{_shape(query)}")
        if G < 1 or H % G:
            raise ValueError(f"{name}.keys has G={G} KV groups; the query's H={H} heads must be a "
                             "multiple of it")
        if k.stride(-1) != 1 and D > 1:
            raise ValueError(f"{name}.keys must have a contiguous last dimension (stride 1), "
                             f"got strides {k.stride()}")
        if src.values is None:
            width = src.value_width
            if isinstance(width, bool) or not isinstance(width, int) or not 1 <= width <= D:
                raise ValueError(f"{name} has values=None (MLA absorbed form): value_width must be an int in "
                                 f"[1, D={D}], got {width!r}")
        else:
            v = src.values
            if not isinstance(v, torch.Tensor) or v.dim() != 4 or tuple(v.shape[:3]) != (B, G, N):
                got = _shape(v) if isinstance(v, torch.Tensor) else type(v).__name__
                raise ValueError(f"{name}.values must be [B={B}, G={G}, N={N}, Dv], got {got}")
            if v.dtype != k.dtype:
                raise ValueError(f"{name}.values must have the keys' dtype {k.dtype}, got {v.dtype}")
            _on(f"{name}.values", v, device)
            if v.stride(-1) != 1 and v.shape[-1] > 1:
                raise ValueError(f"{name}.values must have a contiguous last dimension (stride 1), "
                                 f"got strides {v.stride()}")
            width = v.shape[-1]
            if width < 1:
                raise ValueError(f"{name}.values has Dv=0; the value width must be >= 1")
            if src.value_width is not None and src.value_width != width:
                raise ValueError(f"{name}.value_width={src.value_width!r} disagrees with values' Dv={width} "
                                 "(value_width is only for values=None)")
        if out and width != out[0].value_width:
            raise ValueError(f"{name} has value width {width}, sources[0] {out[0].value_width}: "
                             "all sources must share Dv")
        positions = N
        if src.indices is not None:
            idx = src.indices
            if not isinstance(idx, torch.Tensor) or idx.dtype not in INDEX_DTYPES:
                got = idx.dtype if isinstance(idx, torch.Tensor) else type(idx).__name__
                raise ValueError(f"{name}.indices must be an int32 or int64 tensor, got {got}")
            if idx.dim() != 3 or tuple(idx.shape[:2]) != (B, G):
                raise ValueError(f"{name}.indices must have shape [B={B}, G={G}, K], got {_shape(idx)}")
            _on(f"{name}.indices", idx, device)
            positions = idx.shape[2]
        if src.length is not None:
            ln = src.length
            if not isinstance(ln, torch.Tensor) or ln.dtype not in INDEX_DTYPES or tuple(ln.shape) != (B,):
                got = f"{ln.dtype} {_shape(ln)}" if isinstance(ln, torch.Tensor) else type(ln).__name__
                raise ValueError(f"{name}.length must be an int32 or int64 tensor of shape [B={B}], "
                                 f"got {got}")
            _on(f"{name}.length (a tensor on the query's device)", ln, device)
        _check_flag(f"{name}.valid", src.valid, (B, G, positions), device)
        _check_flag(f"{name}.head_valid", src.head_valid, (B, H, positions), device)
        _check_flag(f"{name}.pool_valid", src.pool_valid, (B, G, N), device)
        if src.pool_valid is not None and fold:
            src = _fold_pool_valid(src, N)
        out.append(_Source(src, G, N, positions, width))
    return out


def _fold_pool_valid(src: Rows, pool: int) -> Rows:
    """``src`` with its pool flags folded into ``valid`` (one flag per position: the form every implementation but
    the native one reads)."""
    flags = src.pool_valid
    if src.indices is not None:
        flags = flags.gather(2, src.indices.to(torch.int64).clamp(0, max(pool - 1, 0))) if pool else \
            torch.zeros(src.indices.shape, dtype=torch.bool, device=flags.device)
    valid = flags if src.valid is None else src.valid & flags
    return dataclasses.replace(src, valid=valid, pool_valid=None)


# ----------------------------------------------------------------------------------------------------
# the PyTorch reference
# ----------------------------------------------------------------------------------------------------


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


def _rows(s: _Source, start: int, stop: int, value: bool = False) -> torch.Tensor:
    """Positions ``[start, stop)`` of a source's keys (or values) ``[B, G, stop - start, *]`` in fp32."""
    src = s.rows
    pool = src.values if value and src.values is not None else src.keys
    if value and src.values is None:
        pool = pool[..., : s.value_width]
    if src.indices is None:
        return pool[:, :, start:stop].float()
    idx = src.indices[:, :, start:stop].to(torch.int64).clamp(0, max(s.pool - 1, 0))
    if s.pool == 0:  # nothing to gather: every entry is unreadable (masked by _readable)
        return pool.new_zeros(*idx.shape, pool.shape[-1], dtype=torch.float32)
    return torch.gather(pool, 2, idx[..., None].expand(*idx.shape, pool.shape[-1])).float()


def _blocks(s: _Source, batch_groups: int, width: int) -> list[tuple[int, int]]:
    step = max(1, REFERENCE_ROW_BLOCK_ELEMENTS // max(1, batch_groups * width))
    return [(a, min(a + step, s.positions)) for a in range(0, s.positions, step)]


@dataclass
class Attended:
    """Decode attention over some of a step's sources, before the last merge (:func:`attend`, :func:`merge`).

    ``out [B, H, Dv]`` is normalised over this part's readable rows (fp32, or the query's dtype where an
    implementation writes that); ``lse [B, H]`` fp32 their log-sum-exp (``-inf``: none readable); ``best [B, H]``
    fp32 the best scaled score among them (asked with ``best=True``: VestigeKV's s*); ``mass`` per source
    ``[B, H, N']`` fp32: the probability each position got within this part (``mass=True``: H2O's accumulator).
    """

    out: torch.Tensor | None
    lse: torch.Tensor | None = None
    best: torch.Tensor | None = None
    mass: list[torch.Tensor] | None = None
    # a deferred part (attend(..., defer=True)): each source's masked scores [B, H, N'] fp32, and the sources, which
    # a later attend(..., prior=part) joins into one softmax with its own
    scores: list[torch.Tensor] | None = None
    sources: list | None = None


def _reference(query: torch.Tensor, checked: list[_Source], scaling: float, *, best: bool = False,
               mass: bool = False) -> Attended:
    B, H, D = query.shape
    Dv = checked[0].value_width
    scores, group_masks = [], []
    for s in checked:
        G, hpg = s.groups, H // s.groups
        q = query.to(s.rows.keys.dtype).float().view(B, G, hpg, D)
        sc = query.new_empty(B, G, hpg, s.positions, dtype=torch.float32)
        for a, b in _blocks(s, B * G, D):
            sc[..., a:b] = torch.einsum("bghd,bgnd->bghn", q, _rows(s, a, b)) * scaling
        readable = _readable(_group_readable(query, s), s, H)  # [B, H, N']
        # a row some head of the group may read (what no head may read may hold anything, NaN included)
        group_masks.append(readable.view(B, G, hpg, s.positions).any(dim=2))
        unreadable = ~readable
        scores.append(sc.view(B, H, s.positions).masked_fill(unreadable, float("-inf")))
    joined = torch.cat(scores, dim=-1) if len(scores) > 1 else scores[0]
    lse = torch.logsumexp(joined, dim=-1)  # [B, H]; -inf where nothing is readable
    shift = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)[..., None]
    out = torch.zeros(B, H, Dv, dtype=torch.float32, device=query.device)
    masses = []
    for s, sc, group in zip(checked, scores, group_masks):
        G, hpg = s.groups, H // s.groups
        probs = torch.exp(sc - shift)  # [B, H, N'], 0 for unreadable rows
        masses.append(probs)
        probs = probs.view(B, G, hpg, s.positions)
        for a, b in _blocks(s, B * G, Dv):
            # an unreadable row's content never matters, even NaN in an unused slot of a pool (0 * NaN = NaN)
            v = _rows(s, a, b, value=True).masked_fill(~group[..., a:b, None], 0.0)
            out += torch.einsum("bghn,bgnd->bghd", probs[..., a:b], v).reshape(B, H, Dv)
    return Attended(out, lse, joined.amax(dim=-1) if best else None, masses if mass else None)


def decode_attention_reference(
    query: torch.Tensor, sources: list[Rows], scaling: float, *, splits: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The specification in plain PyTorch with fp32 math (see the module docstring).

    ``splits`` is accepted for the kernels' signature and has no effect: the softmax is exact. Rows are
    upcast a block at a time (at most :data:`REFERENCE_ROW_BLOCK_ELEMENTS` fp32 elements per copy).
    """
    part = _reference(query, _validate(query, sources, scaling, splits), float(scaling))
    return part.out.to(query.dtype), part.lse


# ----------------------------------------------------------------------------------------------------
# the SDPA implementation: torch's fused attention where it applies, the same math in two matmuls elsewhere
# ----------------------------------------------------------------------------------------------------


def _sdpa_mask(query: torch.Tensor, s: _Source) -> torch.Tensor | None:
    """Bool ``[B, H, 1, N']`` of the positions each head may read (None: every position)."""
    src = s.rows
    if src.valid is None and src.length is None and src.indices is None and src.head_valid is None:
        return None
    B, H = query.shape[:2]
    allowed = _group_readable(query, s)  # [B, G, N']
    if src.head_valid is None:
        hpg = H // s.groups
        return allowed[:, :, None, None, :].expand(B, s.groups, hpg, 1, s.positions).reshape(B, H, 1, s.positions)
    return _readable(allowed, s, H)[:, :, None, :]


def _sdpa_rows(s: _Source, value: bool) -> torch.Tensor:
    """A source's keys (or values) ``[B, G, N', *]`` in their dtype: the pool, or its gathered rows."""
    src = s.rows
    pool = src.values if value and src.values is not None else src.keys
    if value and src.values is None:
        pool = pool[..., : s.value_width]
    if src.indices is None:
        return pool
    idx = src.indices.to(torch.int64).clamp(0, max(s.pool - 1, 0))
    return torch.gather(pool, 2, idx[..., None].expand(*idx.shape, pool.shape[-1]))


def _sdpa(query: torch.Tensor, checked: list[_Source], scaling: float, *, lse: bool = False, best: bool = False,
          mass: bool = False, defer: bool = False, prior: Attended | None = None) -> Attended:
    """One source without extras through ``F.scaled_dot_product_attention`` (``enable_gqa``: the rows are read
    in place, the kernels transformers' own SDPA path takes); otherwise per source ``scale * Q K^T`` in the rows'
    dtype (fp32 accumulation, the query rounded to the rows' dtype as the reference does), one fp32 softmax over
    every source (``prior``'s deferred scores included), and the probabilities in the values' dtype times the
    values. ``defer``: stop after the scores (and the best one), for a later part to join.

    Unlike the reference and the kernel, this path multiplies an unreadable row's value by its zero probability:
    unreadable rows must hold finite values (the runtime's always do: zeros past the live rows, real rows
    otherwise); a NaN there would reach the output."""
    import torch.nn.functional as F

    B, H, D = query.shape
    if len(checked) == 1 and prior is None and not (lse or best or mass or defer) \
            and checked[0].pool == checked[0].positions:
        s = checked[0]
        keys, values = _sdpa_rows(s, False), _sdpa_rows(s, True)
        q = query.to(keys.dtype)[:, :, None]
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=_sdpa_mask(query, s), scale=scaling,
                                             enable_gqa=H > s.groups)
        return Attended(out[:, :, 0])
    scores = []
    for s in checked:
        keys = _sdpa_rows(s, False)
        G, hpg = s.groups, H // s.groups
        q = query.to(keys.dtype).view(B, G, hpg, D)
        sc = torch.matmul(q, keys.transpose(-1, -2)).float().mul_(scaling)  # [B, G, hpg, N']
        src = s.rows
        if src.head_valid is not None:  # a flag per head
            sc = sc.view(B, H, s.positions).masked_fill_(~_sdpa_mask(query, s)[:, :, 0], float("-inf"))
        elif src.valid is not None or src.length is not None or src.indices is not None:  # one flag per group row
            sc = sc.masked_fill_(~_group_readable(query, s)[:, :, None], float("-inf")).view(B, H, s.positions)
        scores.append(sc.view(B, H, s.positions))
    best_t = None
    if best:
        best_t = torch.stack([sc.amax(dim=-1) for sc in scores]).amax(0) if len(scores) > 1 else scores[0].amax(-1)
    if defer:
        return Attended(None, best=best_t, scores=scores, sources=checked)
    if prior is not None:
        scores, checked = prior.scores + scores, prior.sources + checked
    joined = torch.cat(scores, dim=-1) if len(scores) > 1 else scores[0]
    # 0 (not NaN) where a head may read no row: out = 0 there (the aten op: torch.compile traces it)
    probs = torch.ops.aten._safe_softmax.default(joined, -1)
    parts = probs.split([s.positions for s in checked], dim=-1) if len(checked) > 1 else [probs]
    out = None
    for s, p in zip(checked, parts):
        values = _sdpa_rows(s, True)
        G = s.groups
        term = torch.matmul(p.to(values.dtype).view(B, G, H // G, s.positions), values)
        out = term if out is None else out + term
    out = out.view(B, H, -1)
    lse_t = torch.logsumexp(joined, dim=-1) if lse else None  # -inf where no row is readable
    return Attended(out, lse_t, best_t if prior is None else prior.best, list(parts) if mass else None)


# ----------------------------------------------------------------------------------------------------
# launch configurations (one function for the launcher and the compile gate)
# ----------------------------------------------------------------------------------------------------


def _pow2(x: int, floor: int = 16) -> int:
    return max(floor, 1 << max(0, (x - 1).bit_length()))


@dataclass(frozen=True)
class SplitConfig:
    """Block sizes, warps, stages and occupancy of the split kernel for one shape and dtype."""

    BLOCK_H: int
    BLOCK_N: int
    BLOCK_D1: int
    BLOCK_D2: int
    BLOCK_DV: int
    D1: int  # the main part of a row: the value width (absorbed form) or the whole key
    D2: int  # the tail (absorbed form: the rope branch), 0 when none
    num_warps: int
    num_stages: int
    max_registers: int  # per thread, the budget that gives ctas_per_sm (the compile gate holds the code to it)
    ctas_per_sm: int  # programs one SM holds at once (registers, shared memory): the splits heuristic's wave
    row_buffers: int  # row tiles in flight (shared-memory buffers of the pipeline)
    score_copies: int  # how many warps compute each score (1: none duplicated)


@dataclass(frozen=True)
class MergeConfig:
    BLOCK_S: int  # splits in one tile (all of them, up to MAX_MERGE_BLOCK_S)
    BLOCK_DV: int
    num_warps: int
    num_stages: int


SM90_REGISTERS = 65_536  # 32-bit registers per SM on H100 / H200
SM90_SHARED_PER_SM = 233_472  # bytes of shared memory per SM on H100 / H200 (228 KiB; 1 KiB of it per block reserved)
MAX_MERGE_BLOCK_S = 1024


def split_config(heads_per_group: int, key_width: int, value_width: int, separate_values: bool,
                 itemsize: int) -> SplitConfig:
    """What the launcher picks for a source (and :func:`shipped_configs` compiles), from the sm_90 code the
    compiler makes (``tests/test_compile_gate.py`` prints it and holds every shipped configuration to it).

    A key row is split into a main part (``D1``: the value width in the absorbed form, whose tile is
    also the value tile, else the whole key) and a tail (``D2``, e.g. MLA's 64-dim rope branch), each
    in a masked power-of-two block of at least 16 (every ``tl.dot`` dimension >= 16).

    * Tensor cores: ``mma.sync`` m16n8k16. Triton lays the warps of chained products (``S = Q K^T``, then
      ``P V``) side by side along the tile's rows, 8 score columns each, so a tile of ``8 x num_warps`` rows
      gives each warp its own scores: 4 warps over 32 latent rows (1,152 B each in bf16) or 64 narrower rows.
      With 32 heads the fp32 accumulator (32 x 512) is 128 registers per thread at 4 warps: 255 registers and
      8-16 B of spills; 8 warps over 64 rows spill 16-96 B; so 8 warps over 32 rows, every score computed by
      two warps (``score_copies``), 1 program per SM, no spills. wgmma (M a multiple of 64: 16 or 32 heads
      padded to 64) holds a 64 x 512 fp32 accumulator: 255 registers and 624-1,728 B of spills at 4, 8 or 16
      warps, so it is not used.
    * Two row tiles in flight in every variant (``num_stages`` 3): the indices and flag words of a tile are
      loaded one iteration ahead, so no row load waits on a load of its own iteration.
    * Occupancy: as many programs per SM as shared memory (two row buffers and the query) allows, capped by a
      register budget the compiled code is held to: 2 programs of 4 warps for latent rows, 3 for 128-dim GQA
      rows (168 registers), 4 for 64-dim ones (128). (Giving ptxas that budget as ``maxnreg`` made it spill
      24-56 B where it needs no cap to stay under it.)
    """
    d1 = key_width if separate_values else value_width
    d2 = key_width - d1
    block_d1, block_d2 = _pow2(d1), _pow2(d2) if d2 else 16
    block_dv = _pow2(value_width) if separate_values else block_d1
    block_h = _pow2(heads_per_group)
    row_bytes = (block_d1 + (block_d2 if d2 else 0) + (block_dv if separate_values else 0)) * itemsize
    block_n = 64 if row_bytes <= 1024 else 32
    warps = 8 if block_h * block_dv >= 16384 else 4
    row_buffers = 2
    q_bytes = block_h * (block_d1 + (block_d2 if d2 else 0)) * itemsize
    shared = row_buffers * block_n * row_bytes + q_bytes + 1024  # + the compiler's scratch, the block's reserve
    by_shared = SM90_SHARED_PER_SM // (shared + 1024)
    if row_bytes > 1024 or warps == 8:
        registers = 255
    else:
        registers = 168 if block_d1 + block_dv > 128 else 128
    by_registers = SM90_REGISTERS // (warps * 32 * -(-registers * 32 // 256) * 256 // 32)
    ctas = max(1, min(4, by_shared, by_registers))
    return SplitConfig(block_h, block_n, block_d1, block_d2, block_dv, d1, d2, warps, 3, registers, ctas,
                       row_buffers, max(1, 8 * warps // block_n))


def merge_config(splits: int) -> MergeConfig:
    """The merge kernel's blocks for a source of ``splits`` splits: every split's log-sum-exp in one tile
    (``BLOCK_S``, up to :data:`MAX_MERGE_BLOCK_S`; more splits are taken in chunks with an online maximum) and a
    slice of ``BLOCK_DV`` output columns, so one program loads one tile of partial outputs (at most 4,096
    floats) at once: one round trip to L2, no loop."""
    block_s = min(MAX_MERGE_BLOCK_S, _pow2(splits, 16))
    return MergeConfig(BLOCK_S=block_s, BLOCK_DV=max(4, min(128, 4096 // block_s)), num_warps=4, num_stages=1)


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return DEFAULT_SMS


def default_splits(batch_groups: int, positions: int, block_n: int, sms: int = DEFAULT_SMS,
                   ctas_per_sm: int = 2) -> int:
    """Splits per source when ``splits=None``: ``batch_groups x splits`` fills the ``sms x ctas_per_sm`` programs
    the chip holds at once (one wave, never a second, partial one), at most one split per tile of ``block_n``
    positions, at least one. No floor of rows per split: a split's partial output stays in L2 for the merge."""
    tiles = -(-positions // block_n)
    return max(1, min(tiles, (sms * ctas_per_sm) // max(1, batch_groups), MAX_SPLITS))


# ----------------------------------------------------------------------------------------------------
# the Triton kernels (built on first use: triton is imported only here)
# ----------------------------------------------------------------------------------------------------


@functools.cache
def _kernels() -> SimpleNamespace:
    import triton
    import triton.language as tl

    globals()["tl"] = tl  # the jitted functions resolve tl through this module's globals

    @triton.jit
    def decode_split_kernel(
        Q, K, V, LENGTH, IDX, FLAGS, PART_O, PART_L, PART_M,
        scale_log2,
        n_pool, n_pos,
        stride_qb, stride_qh,
        stride_kb, stride_kg, stride_kn,
        stride_vb, stride_vg, stride_vn,
        stride_ib, stride_ig, stride_ik,
        stride_fb, stride_fg, stride_fw,
        groups, hpg, splits,
        D1: tl.constexpr, D2: tl.constexpr, DV: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_D1: tl.constexpr, BLOCK_D2: tl.constexpr, BLOCK_DV: tl.constexpr, FLAG_WORDS: tl.constexpr,
        SEPARATE_V: tl.constexpr, GATHER: tl.constexpr, HAS_FLAGS: tl.constexpr,
        HAS_LENGTH: tl.constexpr, FP32: tl.constexpr, ALIGNED: tl.constexpr, BEST: tl.constexpr,
    ):
        pid_bg = tl.program_id(0)
        pid_s = tl.program_id(1)
        b = pid_bg // groups
        g = pid_bg % groups
        b64 = b.to(tl.int64)
        g64 = g.to(tl.int64)
        # this split's positions: the readable prefix [0, n) cut into `splits` runs of whole tiles
        if HAS_LENGTH:
            n = tl.maximum(tl.minimum(tl.load(LENGTH + b).to(tl.int32), n_pos), 0)
        else:
            n = n_pos
        per_split = tl.cdiv(tl.cdiv(n, BLOCK_N), splits) * BLOCK_N
        lo = pid_s * per_split
        hi = tl.minimum(lo + per_split, n)

        offs_h = tl.arange(0, BLOCK_H)
        h_mask = offs_h < hpg
        heads = g * hpg + offs_h
        offs_n = tl.arange(0, BLOCK_N)
        offs_d1 = tl.arange(0, BLOCK_D1)
        d1_mask = offs_d1 < D1
        q_rows = Q + b64 * stride_qb + heads.to(tl.int64)[:, None] * stride_qh
        q1 = tl.load(q_rows + offs_d1[None, :], mask=h_mask[:, None] & d1_mask[None, :], other=0.0)
        q1 = q1.to(K.dtype.element_ty)
        if D2 > 0:
            offs_d2 = tl.arange(0, BLOCK_D2)
            d2_mask = offs_d2 < D2
            q2 = tl.load(q_rows + D1 + offs_d2[None, :], mask=h_mask[:, None] & d2_mask[None, :], other=0.0)
            q2 = q2.to(K.dtype.element_ty)
        if SEPARATE_V:
            offs_dv = tl.arange(0, BLOCK_DV)
            dv_mask = offs_dv < DV
            v_base = V + b64 * stride_vb + g64 * stride_vg
            if ALIGNED:
                v_base = tl.multiple_of(v_base, 16)
        k_base = K + b64 * stride_kb + g64 * stride_kg
        if ALIGNED:  # the launcher checked: 16-byte aligned pools, row strides multiples of 16 elements
            k_base = tl.multiple_of(k_base, 16)
        idx_base = IDX + b64 * stride_ib + g64 * stride_ig
        flag_base = FLAGS + b64 * stride_fb + g64 * stride_fg

        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)
        # A tile's indices and flag words are loaded one iteration ahead, folded into one int32 row number per
        # position (-1: not loaded: past the split, outside the pool, or readable by no head of the group). The row
        # loads of a tile then depend on no load of its own iteration, and the pipeliner keeps as many row tiles in
        # flight as in the dense loop (a row load that waits on a same-iteration flag load got one buffer).
        ahead = lo + offs_n
        if GATHER:
            got = tl.load(idx_base + ahead.to(tl.int64) * stride_ik, mask=ahead < hi, other=-1)
            rows_next = tl.where((got >= 0) & (got < n_pool), got, -1).to(tl.int32)
        else:
            rows_next = tl.where(ahead < hi, ahead, -1)
        if HAS_FLAGS:
            word_next = tl.load(flag_base + ahead, mask=ahead < hi, other=0)
            for w in tl.static_range(1, FLAG_WORDS):
                word_next = word_next | tl.load(flag_base + w * stride_fw + ahead, mask=ahead < hi, other=0)
            rows_next = tl.where(word_next != 0, rows_next, -1)
        for start in range(lo, hi, BLOCK_N):
            rows = rows_next
            if HAS_FLAGS:
                word = word_next
            ahead = start + BLOCK_N + offs_n
            if GATHER:
                got = tl.load(idx_base + ahead.to(tl.int64) * stride_ik, mask=ahead < hi, other=-1)
                rows_next = tl.where((got >= 0) & (got < n_pool), got, -1).to(tl.int32)
            else:
                rows_next = tl.where(ahead < hi, ahead, -1)
            if HAS_FLAGS:
                word_next = tl.load(flag_base + ahead, mask=ahead < hi, other=0)
                for w in tl.static_range(1, FLAG_WORDS):
                    word_next = word_next | tl.load(flag_base + w * stride_fw + ahead, mask=ahead < hi, other=0)
                rows_next = tl.where(word_next != 0, rows_next, -1)
            fetch = rows >= 0
            if HAS_FLAGS:
                # valid and head_valid in int32 words: bit j of word w = head 32 w + j may read the position
                if FLAG_WORDS == 1:
                    head_ok = (word[None, :] >> (offs_h % 32)[:, None]) & 1
                else:  # exactly the words the host packed (ceil(hpg / 32)); heads past them read nothing. These
                    # loads only mask the scores, so they need not come a tile ahead
                    pos = start + offs_n
                    head_ok = tl.zeros([BLOCK_H, BLOCK_N], tl.int32)
                    for w in tl.static_range(FLAG_WORDS):
                        bits = tl.load(flag_base + w * stride_fw + pos, mask=fetch, other=0)
                        bit = (bits[None, :] >> (offs_h % 32)[:, None]) & 1
                        head_ok = tl.where((offs_h // 32 == w)[:, None], bit, head_ok)
                allowed = fetch[None, :] & (head_ok != 0)
            else:
                allowed = fetch[None, :]
            rows = tl.maximum(rows, 0).to(tl.int64)
            k_off = rows * stride_kn
            if ALIGNED:
                k_off = tl.multiple_of(k_off, 16)
            k_rows = k_base + k_off[:, None]
            if D1 == BLOCK_D1:
                k1 = tl.load(k_rows + offs_d1[None, :], mask=fetch[:, None], other=0.0)
            else:
                k1 = tl.load(k_rows + offs_d1[None, :], mask=fetch[:, None] & d1_mask[None, :], other=0.0)
            if FP32:
                s = tl.dot(q1, tl.trans(k1), input_precision="ieee")
            else:
                s = tl.dot(q1, tl.trans(k1))
            if D2 > 0:
                if D2 == BLOCK_D2:
                    k2 = tl.load(k_rows + D1 + offs_d2[None, :], mask=fetch[:, None], other=0.0)
                else:
                    k2 = tl.load(k_rows + D1 + offs_d2[None, :], mask=fetch[:, None] & d2_mask[None, :],
                                 other=0.0)
                if FP32:
                    s = tl.dot(q2, tl.trans(k2), s, input_precision="ieee")
                else:
                    s = tl.dot(q2, tl.trans(k2), s)
            s = tl.where(allowed, s * scale_log2, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            if SEPARATE_V:
                v_off = rows * stride_vn
                if ALIGNED:
                    v_off = tl.multiple_of(v_off, 16)
                if DV == BLOCK_DV:
                    v = tl.load(v_base + v_off[:, None] + offs_dv[None, :], mask=fetch[:, None], other=0.0)
                else:
                    v = tl.load(v_base + v_off[:, None] + offs_dv[None, :],
                                mask=fetch[:, None] & dv_mask[None, :], other=0.0)
            else:
                v = k1
            acc = acc * alpha[:, None]  # rescaled in place, then accumulated into by the product
            if FP32:
                acc = tl.dot(p, v, acc, input_precision="ieee")
            else:
                acc = tl.dot(p.to(v.dtype), v, acc)
            m_i = m_new

        # a split with no positions writes nothing: the merge reads the splits [0, cdiv(n, per_split)) only
        if lo < hi:
            has = l_i > 0
            l_safe = tl.where(has, l_i, 1.0)
            o = acc / l_safe[:, None]
            lse2 = tl.where(has, m_i + tl.log2(l_safe), float("-inf"))
            slot = (b64 * groups * hpg + heads.to(tl.int64)) * splits + pid_s
            tl.store(PART_L + slot, lse2, mask=h_mask)
            if BEST:  # the split's best scaled score (log2 units), for s*: no second read of the rows
                tl.store(PART_M + slot, m_i, mask=h_mask)
            offs_o = tl.arange(0, BLOCK_DV)
            tl.store(PART_O + slot[:, None] * DV + offs_o[None, :], o,
                     mask=h_mask[:, None] & (offs_o < DV)[None, :])

    @triton.jit
    def decode_merge_kernel(
        PART_O, PART_L, PART_M, LENGTH, PRIOR_O, PRIOR_L, PRIOR_M, OUT, LSE, BEST_OUT,
        heads, n_pos, splits, block_n, dv,
        BLOCK_S: tl.constexpr, BLOCK_DV: tl.constexpr, ONE_TILE: tl.constexpr,
        HAS_LENGTH: tl.constexpr, HAS_PRIOR: tl.constexpr, BEST: tl.constexpr, PRIOR_BEST: tl.constexpr,
    ):
        bh = tl.program_id(0).to(tl.int64)
        pid_d = tl.program_id(1)
        b = bh // heads
        # the splits that hold positions, as the split kernel cut them: [0, count)
        if HAS_LENGTH:
            n = tl.maximum(tl.minimum(tl.load(LENGTH + b).to(tl.int32), n_pos), 0)
        else:
            n = n_pos
        tiles = tl.cdiv(n, block_n)
        count = tl.cdiv(tiles, tl.maximum(tl.cdiv(tiles, splits), 1))
        offs_s = tl.arange(0, BLOCK_S)
        offs_d = pid_d * BLOCK_DV + tl.arange(0, BLOCK_DV)
        d_mask = offs_d < dv
        base = bh * splits
        if HAS_PRIOR:  # a part that came before (its lse in natural log): one more term of the same softmax
            prior_l = tl.load(PRIOR_L + bh) * 1.4426950408889634
            prior_o = tl.load(PRIOR_O + bh * dv + offs_d, mask=d_mask, other=0.0).to(tl.float32)
        if ONE_TILE:  # every split's lse in one tile and their outputs in one load: one round trip, no loop
            s_mask = offs_s < count
            ls = tl.load(PART_L + base + offs_s, mask=s_mask, other=float("-inf"))
            o = tl.load(PART_O + (base + offs_s)[:, None] * dv + offs_d[None, :],
                        mask=s_mask[:, None] & d_mask[None, :], other=0.0)
            m = tl.max(ls, 0)
            if HAS_PRIOR:
                m = tl.maximum(m, prior_l)
            m_safe = tl.where(m == float("-inf"), 0.0, m)
            w = tl.exp2(ls - m_safe)
            acc = tl.sum(w[:, None] * o, 0)
            total = tl.sum(w, 0)
            if BEST:
                top = tl.max(tl.load(PART_M + base + offs_s, mask=s_mask, other=float("-inf")), 0)
        else:  # more splits than one tile holds: the maximum first, then one pass over the outputs
            top_l = tl.full([BLOCK_S], float("-inf"), tl.float32)
            top_m = tl.full([BLOCK_S], float("-inf"), tl.float32)
            for s0 in range(0, count, BLOCK_S):
                s_mask = s0 + offs_s < count
                top_l = tl.maximum(top_l, tl.load(PART_L + base + s0 + offs_s, mask=s_mask, other=float("-inf")))
                if BEST:
                    top_m = tl.maximum(top_m, tl.load(PART_M + base + s0 + offs_s, mask=s_mask,
                                                      other=float("-inf")))
            m = tl.max(top_l, 0)
            if HAS_PRIOR:
                m = tl.maximum(m, prior_l)
            m_safe = tl.where(m == float("-inf"), 0.0, m)
            weight = tl.zeros([BLOCK_S], tl.float32)
            acc = tl.zeros([BLOCK_DV], tl.float32)
            for s0 in range(0, count, BLOCK_S):
                s_mask = s0 + offs_s < count
                ls = tl.load(PART_L + base + s0 + offs_s, mask=s_mask, other=float("-inf"))
                w = tl.exp2(ls - m_safe)
                o = tl.load(PART_O + (base + s0 + offs_s)[:, None] * dv + offs_d[None, :],
                            mask=s_mask[:, None] & d_mask[None, :], other=0.0)
                acc += tl.sum(w[:, None] * o, 0)
                weight += w
            total = tl.sum(weight, 0)
            if BEST:
                top = tl.max(top_m, 0)
        if HAS_PRIOR:
            w_prior = tl.exp2(prior_l - m_safe)  # 0 for a prior with no readable row (lse -inf)
            acc += tl.where(w_prior > 0, w_prior * prior_o, 0.0)
            total += w_prior
        has = total > 0
        out = tl.where(has, acc / tl.where(has, total, 1.0), 0.0)
        tl.store(OUT + bh * dv + offs_d, out.to(OUT.dtype.element_ty), mask=d_mask)
        if pid_d == 0:
            lse = tl.where(has, (m_safe + tl.log2(tl.where(has, total, 1.0))) * 0.6931471805599453, float("-inf"))
            tl.store(LSE + bh, lse)
            if BEST:
                best = top * 0.6931471805599453
                if PRIOR_BEST:  # the sources before this one had their best score too
                    best = tl.maximum(best, tl.load(PRIOR_M + bh))
                tl.store(BEST_OUT + bh, best)

    return SimpleNamespace(split=decode_split_kernel, merge=decode_merge_kernel)


def _flag_words(valid: torch.Tensor | None, head_valid: torch.Tensor | None, hpg: int) -> torch.Tensor:
    """``valid [B, G, N']`` and ``head_valid [B, H, N']`` as the kernel reads them: int32 words
    ``[B, G, W, N']`` (``W = ceil(hpg / 32)``, unit stride along ``N'``), bit ``j`` of word ``w`` set when
    head ``32 w + j`` of the group may read the position. One 4-byte word per position instead of a flag
    per head: it is copied asynchronously like an index, so the kernel knows in time which rows not to
    load at all. The kernel reads exactly these ``W`` words (``FLAG_WORDS``), whatever its block of heads."""
    if head_valid is None:  # valid alone: every bit (-1) or none
        B, G, P = valid.shape
        word = valid.to(torch.int32).neg_().contiguous()
        return word[:, :, None, :].expand(B, G, -(-hpg // 32), P)
    B, H, P = head_valid.shape
    groups, words = H // hpg, -(-hpg // 32)
    flags = head_valid.view(B, groups, hpg, P).to(torch.int64)
    if words * 32 != hpg:
        flags = torch.cat([flags, flags.new_zeros(B, groups, words * 32 - hpg, P)], dim=2)
    # device ops only (no host tensor is copied in: a CUDA graph may capture this); the bits are disjoint,
    # so their sum is their OR, < 2**32, and bit 31 becomes int32's sign bit
    weights = torch.ones(32, dtype=torch.int64, device=flags.device) << torch.arange(32, device=flags.device)
    packed = (flags.view(B, groups, words, 32, P) * weights[:, None]).sum(dim=3)
    packed = torch.where(packed >= 1 << 31, packed - (1 << 32), packed).to(torch.int32)
    if valid is not None:
        packed = packed * valid[:, :, None, :]
    return packed.contiguous()


def _aligned(*pools: torch.Tensor) -> bool:
    """Whether every pool starts 16-byte aligned with (batch, group, row) strides that are multiples of 16
    elements: the kernel may then tell the compiler so (vectorised, asynchronously pipelined row loads)."""
    return all(t.data_ptr() % 16 == 0 and all(st % 16 == 0 for st in t.stride()[:3]) for t in pools)


def _split_launch(query: torch.Tensor, s: _Source, splits: int | None,
                  tune: dict | None = None) -> tuple[SplitConfig, int]:
    """The configuration and the split count the launcher takes for one source (``tune``: fields of the
    :class:`SplitConfig` replaced, for ``benchmarks/gpu_kernels.py``'s sweep)."""
    src = s.rows
    H = query.shape[1]
    cfg = split_config(H // s.groups, query.shape[2], s.value_width, src.values is not None,
                       src.keys.element_size())
    if tune:
        cfg = dataclasses.replace(cfg, **tune)
    if splits is None:
        splits = default_splits(query.shape[0] * s.groups, s.positions, cfg.BLOCK_N, _sm_count(query.device),
                                cfg.ctas_per_sm)
    return cfg, splits


def _partials(B: int, H: int, splits: int, Dv: int, best: bool, device: torch.device):
    """The split kernel's outputs per split: ``(out [B, H, S, Dv], lse [B, H, S], best [B, H, S] or lse)``, fp32,
    uninitialised (a split with no positions writes nothing, and the merge reads none of its slots)."""
    part_o = torch.empty(B, H, splits, Dv, dtype=torch.float32, device=device)
    part_l = torch.empty(B, H, splits, dtype=torch.float32, device=device)
    return part_o, part_l, torch.empty_like(part_l) if best else part_l


def _triton(query: torch.Tensor, checked: list[_Source], scaling: float, splits: int | None, *,
            best: bool = False, prior: tuple | None = None, out_dtype: torch.dtype | None = None,
            tune: dict | None = None, merge: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(out [B, H, Dv] in out_dtype (default: the query's), lse [B, H], best [B, H] or None)``: per source the
    split kernel, then the merge kernel, which folds in what came before (the previous source's result, or
    ``prior = (out, lse)``, a part computed earlier) -- one softmax over every source. For the benchmark:
    ``tune`` replaces fields of each source's :class:`SplitConfig`; ``merge=False`` launches the split kernels
    alone and returns the last source's partials ``(out, lse, best)`` per split."""
    B, H, D = query.shape
    if query.device.type == "cpu" and dispatch.interpreting():
        half = [t.dtype for t in [query] + [s.rows.keys for s in checked] if t.dtype == torch.bfloat16]
        if half:
            raise ValueError("decode_attention's kernels in Triton's CPU interpreter: bfloat16 is computed "
                             "wrong there (float16 and float32 are right); test bfloat16 on a GPU or use "
                             "KVZOO_KERNELS=torch")
    kernels = _kernels()
    Dv = checked[0].value_width
    device = query.device
    out_dtype = out_dtype or query.dtype
    if B == 0:
        return (torch.empty(B, H, Dv, dtype=out_dtype, device=device),
                torch.empty(B, H, dtype=torch.float32, device=device),
                torch.empty(B, H, dtype=torch.float32, device=device) if best else None)
    if query.stride(-1) != 1:
        query = query.contiguous()
    carried = None if prior is None else (prior[0], prior[1], None)
    for i, s in enumerate(checked):
        cfg, count = _split_launch(query, s, splits, tune)
        src = s.rows
        keys = src.keys
        values = src.values if src.values is not None else keys
        flags = None
        if src.valid is not None or src.head_valid is not None:
            flags = _flag_words(src.valid, src.head_valid, H // s.groups)
        part_o, part_l, part_m = _partials(B, H, count, Dv, best, device)
        zero3 = (0, 0, 0)
        kernels.split[(B * s.groups, count)](
            query, keys, values,
            src.length if src.length is not None else keys,
            src.indices if src.indices is not None else keys,
            flags if flags is not None else keys,
            part_o, part_l, part_m,
            float(scaling) * LOG2E,
            s.pool, s.positions,
            query.stride(0), query.stride(1),
            keys.stride(0), keys.stride(1), keys.stride(2),
            values.stride(0), values.stride(1), values.stride(2),
            *(src.indices.stride() if src.indices is not None else zero3),
            *(flags.stride()[:3] if flags is not None else zero3),
            s.groups, H // s.groups, count,
            D1=cfg.D1, D2=cfg.D2, DV=Dv,
            BLOCK_H=cfg.BLOCK_H, BLOCK_N=cfg.BLOCK_N,
            BLOCK_D1=cfg.BLOCK_D1, BLOCK_D2=cfg.BLOCK_D2, BLOCK_DV=cfg.BLOCK_DV, FLAG_WORDS=-(-(H // s.groups) // 32),
            SEPARATE_V=src.values is not None, GATHER=src.indices is not None, HAS_FLAGS=flags is not None,
            HAS_LENGTH=src.length is not None,
            FP32=keys.dtype == torch.float32, ALIGNED=_aligned(keys, values), BEST=best,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
        if not merge:
            carried = (part_o, part_l, part_m if best else None)
            continue
        last = i == len(checked) - 1
        out = torch.empty(B, H, Dv, dtype=out_dtype if last else torch.float32, device=device)
        lse = torch.empty(B, H, dtype=torch.float32, device=device)
        top = torch.empty(B, H, dtype=torch.float32, device=device) if best else None
        mcfg = merge_config(count)
        p_out, p_lse, p_best = carried if carried is not None else (out, lse, None)
        kernels.merge[(B * H, -(-Dv // mcfg.BLOCK_DV))](
            part_o, part_l, part_m,
            src.length if src.length is not None else part_l,
            p_out, p_lse, p_best if p_best is not None else lse,
            out, lse, top if top is not None else lse,
            H, s.positions, count, cfg.BLOCK_N, Dv,
            BLOCK_S=mcfg.BLOCK_S, BLOCK_DV=mcfg.BLOCK_DV, ONE_TILE=count <= mcfg.BLOCK_S,
            HAS_LENGTH=src.length is not None, HAS_PRIOR=carried is not None, BEST=best,
            PRIOR_BEST=best and p_best is not None,
            num_warps=mcfg.num_warps, num_stages=mcfg.num_stages,
        )
        carried = (out, lse, top)
    return carried


def decode_attention_triton(
    query: torch.Tensor, sources: list[Rows], scaling: float, *, splits: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The split-K kernels and the merge kernel (see the module docstring); ``splits`` per source."""
    out, lse, _ = _triton(query, _validate(query, sources, scaling, splits), float(scaling), splits)
    return out, lse


# ----------------------------------------------------------------------------------------------------
# the op: one softmax over a step's sources, in parts that merge exactly
# ----------------------------------------------------------------------------------------------------

IMPLEMENTATIONS = ("reference", "sdpa", "triton", "native")


def _triton_part(query: torch.Tensor, checked: list[_Source], scaling: float, splits: int | None, *, best: bool,
                 prior: Attended | None = None, defer: bool = False) -> Attended:
    """A part on the kernel path. Its best score (s*) comes from the split kernel (each split's maximum, reduced
    by the merge: no second read of the rows); a deferred part keeps its output in fp32 for the merge that ends
    the step; ``prior`` (a kernel part) is folded into this part's merge kernel: one softmax over both."""
    if prior is not None:
        out, lse, _ = _triton(query, checked, scaling, splits, prior=(prior.out, prior.lse))
        return Attended(out, lse, prior.best)
    out, lse, top = _triton(query, checked, scaling, splits, best=best,
                            out_dtype=torch.float32 if defer else None)
    return Attended(out, lse, top)


def attend(query: torch.Tensor, sources: list[Rows], scaling: float, *, lse: bool = False, best: bool = False,
           mass: bool = False, defer: bool = False, prior: Attended | None = None, impl: str | None = None,
           splits: int | None = None) -> Attended:
    """Decode attention of ``query [B, H, D]`` over ``sources`` as one part of a step (:class:`Attended`).

    ``lse``/``best``/``mass`` ask for the log-sum-exp, the best score (VestigeKV's s*) and the per-position
    probabilities. A step that must see the tier's best score before it knows which other rows to read asks the
    tier for it with ``defer=True`` (the scores are kept, nothing is normalised yet) and passes that part as
    ``prior`` when it attends over the rest: one softmax over both (the kernel path merges two parts by their
    log-sum-exp instead: the same softmax). ``impl`` is one of :data:`IMPLEMENTATIONS` (None: what
    :func:`kvzoo.kernels.dispatch.decode_impl` picks for the query's device): ``reference`` (the specification),
    ``sdpa`` (torch's fused SDPA where it applies, two matmuls elsewhere) or ``triton`` (the split-K kernels; they
    compute no per-position probabilities, so ``mass`` takes ``sdpa``). Inputs are checked first.
    """
    if impl is None:
        impl = dispatch.decode_impl(query, mass=mass)
        if impl == "sdpa" and _native_applies(query, sources, prior):
            impl = "native"
    checked = _validate(query, sources, scaling, splits, fold=impl != "native")
    scaling = float(scaling)
    if impl == "native":
        return _native_part(query, checked[0].rows, scaling, best=best, mass=mass, defer=defer, prior=prior)
    if impl == "triton" and (mass or (prior is not None and prior.scores is not None)):
        impl = "sdpa"
    if impl == "triton":
        if defer:  # the kernel part stands alone: a later part merges it by its log-sum-exp
            return dispatch.run("decode_attention", _triton_part, _fallback(query, checked, scaling, best=best,
                                defer=True), query, checked, scaling, splits, best=best, defer=True)
        return dispatch.run("decode_attention", _triton_part, _fallback(query, checked, scaling, best=best,
                            lse=True, prior=prior), query, checked, scaling, splits, best=best, prior=prior)
    if prior is not None and prior.scores is None:  # a kernel part before: this one merges with it
        part = attend(query, sources, scaling, lse=True, mass=mass, impl=impl)
        out, lse_t, weights = merge([prior, part], query.dtype)
        return Attended(out, lse_t, prior.best, None if part.mass is None else [m * weights[1][..., None]
                                                                                 for m in part.mass])
    if impl == "sdpa":
        return _sdpa(query, checked, scaling, lse=lse, best=best, mass=mass, defer=defer, prior=prior)
    if impl == "reference":
        if prior is not None or defer:  # the specification has no parts: the whole step, scores and all
            return _sdpa_via_reference(query, checked, scaling, lse=lse, best=best, mass=mass, defer=defer,
                                       prior=prior)
        return _reference(query, checked, scaling, best=best, mass=mass)
    raise ValueError(f"impl must be one of {IMPLEMENTATIONS} or None (the dispatch's choice), got {impl!r}")


# A plain source (a contiguous pool read whole: `full`, a tier compacted at its events) goes to torch's fused SDPA
# -- transformers' own attention -- rather than the native op, so that kvzoo's `full` is the model's own decode.
NATIVE_PLAIN = False


def _native_applies(query: torch.Tensor, sources: list[Rows], prior: Attended | None) -> bool:
    """Whether the native CPU op (``kvzoo.kernels.cpu_native.decode_attend``) takes this part: one source on CPU
    tensors (read where it lies: gathered, or a pool with flags or a length), a prior part it can merge (one the
    op or a kernel computed: no kept scores), and the library built here."""
    if query.device.type != "cpu" or len(sources) != 1 or (prior is not None and prior.scores is not None):
        return False
    src = sources[0]
    if not isinstance(src, Rows):
        return False
    plain = src.indices is None and src.length is None and src.valid is None and src.head_valid is None \
        and src.pool_valid is None
    if plain and prior is None and not NATIVE_PLAIN:
        return False
    from kvzoo.kernels import cpu_native

    return cpu_native.decode_attend_supported(query, src, prior=None if prior is None else (prior.out, prior.lse))


def _native_part(query: torch.Tensor, src: Rows, scaling: float, *, best: bool, mass: bool, defer: bool,
                 prior: Attended | None) -> Attended:
    """:func:`attend` on the native CPU op: one source, merged with ``prior`` (a part the op or a kernel computed)
    into one softmax. The prior's per-position probabilities (``prior.mass``, within its own part) are rescaled to
    the whole step, so ``mass`` lists every source of the step, the prior's first."""
    from kvzoo.kernels import cpu_native

    merge_with = None if prior is None else (prior.out.float(), prior.lse)
    out, lse, top, masses = cpu_native.decode_attend(query, src, scaling, prior=merge_with, best=best, mass=mass)
    mass_list = None
    if mass:
        mass_list = [masses]
        if prior is not None and prior.mass is not None:  # the prior's share of the whole softmax
            weight = torch.exp(prior.lse - lse).nan_to_num_(0.0)[..., None]
            mass_list = [m * weight for m in prior.mass] + mass_list
    if prior is not None:
        top = prior.best
    return Attended(out if defer else out.to(query.dtype), lse, top, mass_list)


def _fallback(query, checked, scaling, **kwargs):
    """The PyTorch path a failing kernel falls back to (``dispatch.run``). A prior that a kernel computed has no
    scores to join: this part is computed alone and merged with it by log-sum-exp."""
    prior = kwargs.get("prior")
    if prior is not None and prior.scores is None:
        def merged(*args, **kw):
            part = _sdpa(query, checked, scaling, lse=True)
            out, lse, _ = merge([prior, part], query.dtype)
            return Attended(out, lse, prior.best)
        return merged
    return lambda *args, **kw: _sdpa(query, checked, scaling, **kwargs)


def _sdpa_via_reference(query, checked, scaling, *, lse, best, mass, defer, prior) -> Attended:
    """``reference`` with parts: a deferred part keeps its sources; the part that ends the step runs the
    specification over every source of the step at once."""
    if defer:
        part = _sdpa(query, checked, scaling, best=best, defer=True)
        return Attended(None, best=part.best, scores=part.scores, sources=checked)
    whole = _reference(query, prior.sources + checked, scaling, mass=mass)
    return Attended(whole.out, whole.lse, prior.best, whole.mass)


def merge(parts: list[Attended], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None, list | None]:
    """One softmax from parts over disjoint rows: ``(out [B, H, Dv] in dtype, lse [B, H], weights)``.

    ``weights[i] [B, H]`` is the share of part ``i`` in the whole (``exp(lse_i - lse)``): a part's ``mass``
    times its weight is the probability each of its positions got in the step. One part merges to itself
    (``weights`` None).
    """
    if len(parts) == 1:
        part = parts[0]
        return part.out.to(dtype), part.lse, None
    lses = torch.stack([p.lse for p in parts])  # [P, B, H]
    total = torch.logsumexp(lses, dim=0)
    shift = torch.where(torch.isinf(total), torch.zeros_like(total), total)
    weights = torch.exp(lses - shift)  # [P, B, H]; 0 for a part with no readable row
    out = sum(w[..., None] * p.out.float().nan_to_num(0.0) for w, p in zip(weights, parts))
    return out.to(dtype), total, list(weights)


def decode_attention(
    query: torch.Tensor, sources: list[Rows], scaling: float, *, splits: int | None = None, impl: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode attention of ``query [B, H, D]`` over ``sources``: ``(out [B, H, Dv], lse [B, H] fp32)``.

    One softmax over every readable row of every source (module docstring), by the implementation
    ``impl`` names or :func:`kvzoo.kernels.dispatch.decode_impl` picks (:func:`attend`). Inputs are checked
    first, so a bad input raises a ValueError on every path (never a kernel fallback).
    """
    part = attend(query, sources, scaling, lse=True, impl=impl, splits=splits)
    return part.out.to(query.dtype), part.lse


# ----------------------------------------------------------------------------------------------------
# what ships: the specialisations the launcher picks for the shipped models (the sm_90 compile gate)
# ----------------------------------------------------------------------------------------------------

# (name, heads per KV group, key width D, value width Dv, separate values)
SHIPPED_SHAPES = (
    ("mla576-v512-h16", 16, 576, 512, False),  # DeepSeek-V2-Lite: 16 heads over one latent group
    ("mla576-v512-h32", 32, 576, 512, False),  # Kimi Linear 48B's MLA layers: 32 heads
    ("gqa64-hpg3", 3, 64, 64, True),  # SmolLM2-135M: 9 heads / 3 KV heads
    ("gqa128-hpg4", 4, 128, 128, True),
    ("gqa128-hpg8", 8, 128, 128, True),
)
SHIPPED_DTYPES = (torch.bfloat16, torch.float16)
# the optional inputs change the code: a plain dense pool (every row valid), a pool with valid flags and a device
# length that also returns its best score (the runtime's tier in a retrieving step), and every option on (gathered
# rows with flags). The pool and gathered variants' row loads wait on a flag or an index: they get their own stages.
SHIPPED_VARIANTS = {
    "dense": {"GATHER": False, "HAS_FLAGS": False, "HAS_LENGTH": False, "BEST": False},
    "pool": {"GATHER": False, "HAS_FLAGS": True, "HAS_LENGTH": True, "BEST": True},
    "gathered": {"GATHER": True, "HAS_FLAGS": True, "HAS_LENGTH": True, "BEST": False},
}
# the merge kernel as the op launches it: a whole step in one call, the deferred part of a retrieving step (fp32
# output and the best score) and the part that ends it (the deferred part folded in)
SHIPPED_MERGES = {
    "plain": {"HAS_LENGTH": True, "HAS_PRIOR": False, "BEST": False, "PRIOR_BEST": False},
    "deferred": {"HAS_LENGTH": False, "HAS_PRIOR": False, "BEST": True, "PRIOR_BEST": False},
    "prior": {"HAS_LENGTH": False, "HAS_PRIOR": True, "BEST": False, "PRIOR_BEST": False},
}
# the (batch, positions) cases the compile gate prints the grid of: the whole context and its 1/32 kept in the tier
# (32k and 128k rows), and a retriever's 16 fetched rows
GRID_CASES = tuple((b, n) for b in (1, 4, 8) for n in (16, 1024, 4096, 32_768, 131_072))
_TRITON_TYPE = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.int32: "i32",
                torch.int64: "i64"}


def split_specialisation(cfg: SplitConfig, dtype: torch.dtype, value_width: int, separate_values: bool,
                         flags: dict[str, bool], index_dtype: torch.dtype = torch.int64,
                         length_dtype: torch.dtype = torch.int64,
                         heads_per_group: int = 16) -> tuple[dict[str, str], dict[str, object]]:
    """The split kernel's argument types and constexprs for the compile gate, as the launcher passes them
    (an absent optional tensor is passed as the keys, so it has their type)."""
    elem = "*" + _TRITON_TYPE[dtype]
    pointer = {
        "Q": elem, "K": elem, "V": elem,
        "LENGTH": "*" + _TRITON_TYPE[length_dtype] if flags["HAS_LENGTH"] else elem,
        "IDX": "*" + _TRITON_TYPE[index_dtype] if flags["GATHER"] else elem,
        "FLAGS": "*i32" if flags["HAS_FLAGS"] else elem,
        "PART_O": "*fp32", "PART_L": "*fp32", "PART_M": "*fp32",
    }
    ints = ["n_pool", "n_pos", "stride_qb", "stride_qh", "stride_kb", "stride_kg", "stride_kn",
            "stride_vb", "stride_vg", "stride_vn", "stride_ib", "stride_ig", "stride_ik",
            "stride_fb", "stride_fg", "stride_fw", "groups", "hpg", "splits"]
    constexprs = {
        "D1": cfg.D1, "D2": cfg.D2, "DV": value_width, "BLOCK_H": cfg.BLOCK_H, "BLOCK_N": cfg.BLOCK_N,
        "BLOCK_D1": cfg.BLOCK_D1, "BLOCK_D2": cfg.BLOCK_D2, "BLOCK_DV": cfg.BLOCK_DV,
        "FLAG_WORDS": -(-heads_per_group // 32),
        "SEPARATE_V": separate_values, **flags, "FP32": dtype == torch.float32,
        "ALIGNED": True,  # the shipped shapes' row strides (576, 64, 128 elements) and torch's allocations
    }
    signature = {**pointer, "scale_log2": "fp32", **{name: "i32" for name in ints},
                 **{name: "constexpr" for name in constexprs}}
    return signature, constexprs


def merge_specialisation(mcfg: MergeConfig, out_dtype: torch.dtype, prior_dtype: torch.dtype, flags: dict[str, bool],
                         splits: int) -> tuple[dict[str, str], dict[str, object]]:
    """The merge kernel's argument types and constexprs for the compile gate, as the launcher passes them."""
    out = "*" + _TRITON_TYPE[out_dtype]
    pointer = {"PART_O": "*fp32", "PART_L": "*fp32", "PART_M": "*fp32",
               "LENGTH": "*i64" if flags["HAS_LENGTH"] else "*fp32",
               "PRIOR_O": "*" + _TRITON_TYPE[prior_dtype] if flags["HAS_PRIOR"] else out,
               "PRIOR_L": "*fp32", "PRIOR_M": "*fp32", "OUT": out, "LSE": "*fp32", "BEST_OUT": "*fp32"}
    constexprs = {"BLOCK_S": mcfg.BLOCK_S, "BLOCK_DV": mcfg.BLOCK_DV, "ONE_TILE": splits <= mcfg.BLOCK_S, **flags}
    signature = {**pointer, **{name: "i32" for name in ("heads", "n_pos", "splits", "block_n", "dv")},
                 **{name: "constexpr" for name in constexprs}}
    return signature, constexprs


@dataclass(frozen=True)
class ShippedSplit:
    """What the compile gate holds one shipped split configuration to (besides the compiled code's limits)."""

    shape: str
    heads_per_group: int
    dtype: torch.dtype
    variant: str
    config: SplitConfig


def shipped_splits() -> list[ShippedSplit]:
    """The split kernel's shipped configurations, with the launch configuration each is built for."""
    out = []
    for name, hpg, width, value_width, separate in SHIPPED_SHAPES:
        for dtype in SHIPPED_DTYPES:
            for variant in SHIPPED_VARIANTS:
                cfg = split_config(hpg, width, value_width, separate, torch.empty((), dtype=dtype).element_size())
                out.append(ShippedSplit(name, hpg, dtype, variant, cfg))
    return out


def grid_table(sms: int = DEFAULT_SMS) -> list[dict[str, object]]:
    """The grid the splits heuristic gives each shipped shape (bf16, its pool variant) for :data:`GRID_CASES` on
    ``sms`` SMs: splits, programs, the programs the chip holds at once (``sms x ctas_per_sm``), and the merge's
    block of splits."""
    rows = []
    for name, hpg, width, value_width, separate in SHIPPED_SHAPES:
        cfg = split_config(hpg, width, value_width, separate, 2)
        groups = 1 if not separate else {3: 3, 4: 8, 8: 4}.get(hpg, 1)  # SmolLM2: 3 KV heads; Llama-like: 8 / 4
        for batch, positions in GRID_CASES:
            splits = default_splits(batch * groups, positions, cfg.BLOCK_N, sms, cfg.ctas_per_sm)
            rows.append({"shape": name, "batch": batch, "groups": groups, "positions": positions,
                         "tiles": -(-positions // cfg.BLOCK_N), "splits": splits,
                         "programs": batch * groups * splits, "slots": sms * cfg.ctas_per_sm,
                         "merge_block_s": merge_config(splits).BLOCK_S})
    return rows


def shipped_configs() -> list:
    """Every configuration the launcher picks for :data:`SHIPPED_SHAPES` x :data:`SHIPPED_DTYPES` x
    :data:`SHIPPED_VARIANTS`, and the merge kernel per output dtype, :data:`SHIPPED_MERGES` variant and block of
    splits the heuristic gives for :func:`grid_table` (``tests/test_compile_gate.py``)."""
    from kvzoo.kernels.compile_gate import KernelConfig

    kernels = _kernels()
    configs = []
    for shipped in shipped_splits():
        cfg = shipped.config
        value_width = next(v for n, _, _, v, _ in SHIPPED_SHAPES if n == shipped.shape)
        separate = next(sep for n, _, _, _, sep in SHIPPED_SHAPES if n == shipped.shape)
        signature, constexprs = split_specialisation(cfg, shipped.dtype, value_width, separate,
                                                     SHIPPED_VARIANTS[shipped.variant],
                                                     heads_per_group=shipped.heads_per_group)
        label = f"decode_split-{shipped.shape}-{_TRITON_TYPE[shipped.dtype]}-{shipped.variant}"
        elem = _TRITON_TYPE[shipped.dtype]
        tiles = [(cfg.BLOCK_N, cfg.BLOCK_D1, elem)]
        tiles.append((cfg.BLOCK_N, cfg.BLOCK_DV, elem) if separate else (cfg.BLOCK_N, cfg.BLOCK_D2, elem))
        expect = {"mma": "mma.sync.m16n8k16", "row_tiles": tiles, "row_buffers": cfg.row_buffers,
                  "ctas_per_sm": cfg.ctas_per_sm, "score_tile": (cfg.BLOCK_H, cfg.BLOCK_N),
                  "score_copies": cfg.score_copies}
        expect["max_registers"] = cfg.max_registers
        configs.append(KernelConfig(label, kernels.split, signature, constexprs, cfg.num_warps, cfg.num_stages,
                                    expect=expect))
    block_s = sorted({row["merge_block_s"] for row in grid_table()})
    for dtype in SHIPPED_DTYPES:  # the output dtype changes one cast: one dtype at every block of splits
        for variant, flags in SHIPPED_MERGES.items():
            for bs in block_s if dtype == SHIPPED_DTYPES[0] else block_s[-1:]:
                mcfg = merge_config(bs)
                out_dtype = torch.float32 if variant == "deferred" else dtype
                signature, constexprs = merge_specialisation(mcfg, out_dtype, torch.float32, flags, bs)
                configs.append(KernelConfig(f"decode_merge-{_TRITON_TYPE[dtype]}-{variant}-S{bs}", kernels.merge,
                                            signature, constexprs, mcfg.num_warps, mcfg.num_stages,
                                            expect={"ctas_per_sm": 4}))
    return configs
