"""Gathered decode attention over several row sources, one softmax: the op, one specification, four forms.

One decode step, ``query [B, H, D]`` (one query per sequence), reads rows from one or more :class:`Rows` sources
(the attended pool, the rows a retriever fetched, ...). Every readable row of every source joins **one** softmax;
the result is the output ``[B, H, Dv]`` (the query's dtype) and the natural-log log-sum-exp ``[B, H]`` (fp32).

A source holds ``keys [B, G, N, D]`` (query head ``h`` reads group ``h // (H // G)``) and either ``values [B, G, N,
Dv]`` (GQA) or ``values=None`` with ``value_width=Dv`` (MLA absorbed: a row's value is its first ``Dv`` dims, so a
576-dim latent row is loaded once for both products). A query head reads a position (a pool row ``n``, or in the
gathered form an entry ``i`` of ``indices``) when all of these allow it:

* ``length [B]`` (a device tensor, so a launch can be graph-captured): positions ``[0, length[b])`` only;
* ``indices [B, G, K]`` (gathered form): position ``i`` is the row ``keys[b, g, indices[b, g, i]]`` (a duplicate
  is read twice); an index outside ``[0, N)`` is unreadable (``-1`` may pad; nothing reads outside the pool);
* ``valid [B, G, N']`` (``N' = N``, or ``K`` in the gathered form) per position, ``head_valid [B, H, N']`` per
  query head and position (Quest picks pages per head).

What a row no head of its group may read holds never matters (a preallocated pool, passed whole with ``length``
marking its filled prefix, may hold NaN there).

Scores are ``scaling * <q, k>`` in fp32: the query rounded to the rows' dtype, the products accumulated in fp32 and
kept in fp32 (never rounded back: the best score s*, ``best=True``, is VestigeKV's retrieval floor, compared with
certified fp32 bounds, and a bf16 s* would move which archived rows clear it between the decode and the multi-token
path). The softmax is fp32 and the output is cast to the query's dtype. A ``(b, h)`` with no readable row gets ``out =
0`` and ``lse = -inf`` (never NaN).

A step comes in one or two *parts* (:func:`attend`): a step that must see the tier's best score before it knows which
other rows to read asks for it with ``defer=True`` and passes that part as ``prior`` when it attends over the rest;
the two make one softmax. The forms (``impl``): ``reference`` (:mod:`.reference`, the specification), ``sdpa``
(:mod:`.sdpa`, torch's fused SDPA where it applies), ``triton`` (:mod:`.triton`, split-K kernels) and ``native``
(``kvzoo.kernels.cpu_native.decode_attend``); ``tests/test_decode_attention_reference.py``,
``tests/test_native_decode_attention.py`` and ``tests/interpreter/test_decode_attention.py`` hold the others to the
reference on one list of cases.
"""

from __future__ import annotations

import torch

from kvzoo.kernels import dispatch
from kvzoo.kernels.decode_attention import reference, sdpa, triton
from kvzoo.kernels.decode_attention.reference import decode_attention_reference
from kvzoo.kernels.decode_attention.rows import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    MAX_SPLITS,
    Attended,
    Rows,
    _fold,
    _Source,
    _validate,
)
from kvzoo.kernels.decode_attention.triton import (
    DEFAULT_SMS,
    MAX_MERGE_BLOCK_S,
    MergeConfig,
    SplitConfig,
    decode_attention_triton,
    default_splits,
    merge_config,
    split_config,
)

IMPLEMENTATIONS = ("reference", "sdpa", "triton", "native")
__all__ = ["DEFAULT_SMS", "FLOAT_DTYPES", "IMPLEMENTATIONS", "INDEX_DTYPES", "MAX_MERGE_BLOCK_S", "MAX_SPLITS",
           "Attended", "MergeConfig", "Rows", "SplitConfig", "attend", "decode_attention",
           "decode_attention_reference", "decode_attention_triton", "default_splits", "merge_config",
           "reference", "sdpa", "split_config", "triton"]


def attend(query: torch.Tensor, sources: list[Rows], scaling: float, *, lse: bool = False, best: bool = False,
           mass: bool = False, defer: bool = False, prior: Attended | None = None, impl: str | None = None,
           splits: int | None = None) -> Attended:
    """Decode attention of ``query [B, H, D]`` over ``sources`` as one part of a step (:class:`Attended`): ``lse``,
    ``best`` (s*) and ``mass`` (per-position probabilities) asked for; ``defer``/``prior``: the parts protocol;
    ``impl`` one of :data:`IMPLEMENTATIONS` or None (:func:`_choose`). Inputs are checked first."""
    checked = _validate(query, sources, scaling, splits, fold=False)
    if impl is None:
        impl = _choose(query, checked, prior, mass)
    scaling = float(scaling)
    if impl == "native":
        return _native_part(query, checked[0], scaling, best=best, mass=mass, defer=defer, prior=prior)
    checked = _fold(checked)
    if impl == "reference":  # the specification runs every case itself, the parts protocol included
        return reference.attend_reference(query, checked, scaling, best=best, mass=mass, defer=defer, prior=prior)
    if impl == "triton" and (mass or (prior is not None and prior.scores is not None)):
        impl = "sdpa"
    if impl == "triton":
        if defer:  # the kernel part stands alone: a later part merges it by its log-sum-exp
            return dispatch.run("decode_attention", triton.attend_triton, _fallback(query, checked, scaling,
                                best=best, defer=True), query, checked, scaling, splits, best=best, defer=True)
        return dispatch.run("decode_attention", triton.attend_triton, _fallback(query, checked, scaling, best=best,
                            lse=True, prior=prior), query, checked, scaling, splits, best=best, prior=prior)
    if impl != "sdpa":
        raise ValueError(f"impl must be one of {IMPLEMENTATIONS} or None (the dispatch's choice), got {impl!r}")
    return sdpa.attend_sdpa(query, checked, scaling, lse=lse, best=best, mass=mass, defer=defer, prior=prior)


def _choose(query: torch.Tensor, checked: list[_Source], prior: Attended | None, mass: bool) -> str:
    """The implementation :func:`attend` takes when none is named: Triton where
    :func:`kvzoo.kernels.dispatch.use_triton` says so (not for ``mass``: the kernels compute no per-position
    probabilities), on CPU the native op where it takes the part (one source read where it lies, a prior it can
    merge, sizes the op takes, the library built here), else SDPA."""
    chosen = dispatch.mode()
    if (query.is_cuda or chosen == "triton") and dispatch.use_triton(query) and not mass:
        return "triton"
    if chosen == "torch" or query.device.type != "cpu" or len(checked) != 1 or (prior is not None
                                                                              and prior.scores is not None):
        return "sdpa"
    src = checked[0].rows
    # a plain source (a contiguous pool read whole: `full`, a tier compacted at its events) goes to torch's fused
    # SDPA -- transformers' own attention -- rather than the native op, so that kvzoo's `full` is the model's decode
    plain = src.indices is None and src.length is None and src.valid is None and src.head_valid is None \
        and src.pool_valid is None
    if plain and prior is None:
        return "sdpa"
    from kvzoo.kernels import cpu_native

    return "native" if cpu_native.decode_attend_takes(query, src, checked[0].groups, checked[0].value_width) \
        else "sdpa"


def _native_part(query: torch.Tensor, checked: _Source, scaling: float, *, best: bool, mass: bool, defer: bool,
                 prior: Attended | None) -> Attended:
    """:func:`attend` on the native CPU op: one checked source, merged with ``prior`` (a part the op or a kernel
    computed) into one softmax. The prior's per-position probabilities (``prior.mass``, within its own part) are
    rescaled to the whole step, so ``mass`` lists every source of the step, the prior's first."""
    from kvzoo.kernels import cpu_native

    merge_with = None if prior is None else (prior.out.float(), prior.lse)
    out, lse, top, masses = cpu_native.decode_attend(query, checked.rows, scaling, prior=merge_with, best=best,
                                                     mass=mass)  # the op, which checks the inputs again in C++
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
    """The PyTorch path a failing kernel falls back to (``dispatch.run``): the SDPA form, which joins a kernel's
    prior part to its softmax by its log-sum-exp."""
    return lambda *args, **kw: sdpa.attend_sdpa(query, checked, scaling, **kwargs)


def decode_attention(
    query: torch.Tensor, sources: list[Rows], scaling: float, *, splits: int | None = None, impl: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode attention of ``query [B, H, D]`` over ``sources``: ``(out [B, H, Dv], lse [B, H] fp32)``, one softmax
    over every readable row of every source by :func:`attend` (a bad input raises a ValueError on every path)."""
    part = attend(query, sources, scaling, lse=True, impl=impl, splits=splits)
    return part.out.to(query.dtype), part.lse

