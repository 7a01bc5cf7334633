"""The specification of decode attention in plain PyTorch, fp32 math (fla's ``naive.py``; ``math=torch.float64`` for a
check of an fp32 path), the parts protocol
included: a two-part step is one softmax over the rows of both parts (a deferred part keeps its sources, read again by
the part that ends the step). A prior it cannot read again (a kernel's or the native op's ``(out, lse)``) joins as
one more term: a part normalised with log-sum-exp ``lse`` is exactly what one row of score ``lse`` and value ``out``
adds to a softmax. Rows are upcast :data:`REFERENCE_ROW_BLOCK_ELEMENTS` elements at a time.
"""

from __future__ import annotations

import torch

from kvzoo.kernels.decode_attention.rows import Attended, Rows, _group_readable, _readable, _Source, _validate

# Most elements (in the math dtype) of one block of rows the reference upcasts at once (its extra memory).
REFERENCE_ROW_BLOCK_ELEMENTS = 1 << 22


def _rows(s: _Source, start: int, stop: int, value: bool = False, math: torch.dtype = torch.float32) -> torch.Tensor:
    """Positions ``[start, stop)`` of a source's keys (or values) ``[B, G, stop - start, *]`` in ``math``."""
    src = s.rows
    pool = src.values if value and src.values is not None else src.keys
    if value and src.values is None:
        pool = pool[..., : s.value_width]
    if src.indices is None:
        return pool[:, :, start:stop].to(math)
    idx = src.indices[:, :, start:stop].to(torch.int64).clamp(0, max(s.pool - 1, 0))
    if s.pool == 0:  # nothing to gather: every entry is unreadable (masked by _readable)
        return pool.new_zeros(*idx.shape, pool.shape[-1], dtype=math)
    return torch.gather(pool, 2, idx[..., None].expand(*idx.shape, pool.shape[-1])).to(math)


def _blocks(s: _Source, batch_groups: int, width: int) -> list[tuple[int, int]]:
    step = max(1, REFERENCE_ROW_BLOCK_ELEMENTS // max(1, batch_groups * width))
    return [(a, min(a + step, s.positions)) for a in range(0, s.positions, step)]


def scores(query: torch.Tensor, s: _Source, scaling: float, *,
           math: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """One source's scores ``[B, H, N']`` in ``math`` (``-inf`` where a head may not read) and which of its positions
    some head of the group may read ``[B, G, N']`` (what no head may read may hold anything, NaN included)."""
    B, H, D = query.shape
    G, hpg = s.groups, H // s.groups
    q = query.to(s.rows.keys.dtype).to(math).view(B, G, hpg, D)
    sc = query.new_empty(B, G, hpg, s.positions, dtype=math)
    for a, b in _blocks(s, B * G, D):
        sc[..., a:b] = torch.einsum("bghd,bgnd->bghn", q, _rows(s, a, b, math=math)) * scaling
    readable = _readable(_group_readable(query, s), s, H)  # [B, H, N']
    group = readable.view(B, G, hpg, s.positions).any(dim=2)
    return sc.view(B, H, s.positions).masked_fill(~readable, float("-inf")), group


def attend_reference(query: torch.Tensor, checked: list[_Source], scaling: float, *, best: bool = False,
                     mass: bool = False, defer: bool = False, prior: Attended | None = None,
                     math: torch.dtype = torch.float32) -> Attended:
    """One part of a step (``attend``'s arguments; ``checked`` validated). With a prior that kept its sources this
    is the softmax over the prior's sources and these (``mass`` lists all of them, the prior's first); with a prior
    that did not, the prior joins as one term ``(lse, out)`` (its ``mass`` rescaled to the whole step). ``math``:
    the dtype of the scores, the softmax and the output (fp32, the specification; float64 checks an fp32 path)."""
    B, H, _ = query.shape
    if prior is not None and prior.sources is not None:
        checked = prior.sources + checked
    found = [scores(query, s, scaling, math=math) for s in checked]
    joined = torch.cat([sc for sc, _ in found], dim=-1) if len(found) > 1 else found[0][0]
    merged = prior is not None and prior.sources is None  # a kernel's or the native op's part: (out, lse)
    terms = torch.cat([prior.lse.to(math)[..., None], joined], dim=-1) if merged else joined
    lse = torch.logsumexp(terms, dim=-1)  # [B, H]; -inf where nothing is readable
    shift = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)[..., None]
    Dv = checked[0].value_width
    out = torch.zeros(B, H, Dv, dtype=math, device=query.device)
    masses = []
    for s, (sc, group) in zip(checked, found):
        G, hpg = s.groups, H // s.groups
        probs = torch.exp(sc - shift)  # [B, H, N'], 0 for unreadable rows
        masses.append(probs)
        probs = probs.view(B, G, hpg, s.positions)
        for a, b in _blocks(s, B * G, Dv):
            # an unreadable row's content never matters, even NaN in an unused slot of a pool (0 * NaN = NaN)
            v = _rows(s, a, b, value=True, math=math).masked_fill(~group[..., a:b, None], 0.0)
            out += torch.einsum("bghn,bgnd->bghd", probs[..., a:b], v).reshape(B, H, Dv)
    if merged:
        weight = torch.exp(prior.lse.to(math)[..., None] - shift)  # [B, H, 1]; 0 for a prior with no readable row
        out += torch.where(weight > 0, weight * prior.out.to(math), 0.0)
        if prior.mass is not None:
            masses = [m * weight for m in prior.mass] + masses
    if prior is not None:
        top = prior.best
    else:
        top = joined.amax(dim=-1) if best else None
    if defer:  # kept for the part that ends the step: its sources (to read again), its scores (for sdpa)
        return Attended(out, lse, top, masses if mass else None, scores=[sc for sc, _ in found], sources=checked)
    return Attended(out, lse, top, masses if mass else None)


def decode_attention_reference(
    query: torch.Tensor, sources: list[Rows], scaling: float, *, splits: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The specification in plain PyTorch with fp32 math (the package's docstring): ``(out [B, H, Dv], lse [B, H])``.
    ``splits`` is accepted for the kernels' signature and has no effect: the softmax is exact."""
    part = attend_reference(query, _validate(query, sources, scaling, splits), float(scaling))
    return part.out.to(query.dtype), part.lse
