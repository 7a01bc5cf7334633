"""Index scans over the archive (PyTorch references and fused Triton kernels): *upper bounds* on the attention
score ``scale * <q, k>`` of archived rows from a small index (certified sketch bounds, int8 key bounds, Quest page
bounds), so the retrieval tier fetches only the rows that could matter. A bound is one inner product per (query,
entry), its float slack a column: a scan is ``scale * Q @ E^T`` for query rows ``Q [B, G, hq, W]`` and entries ``E
[B, G, m, W]``. :func:`index_scan` and :func:`index_scan_reduce` are each a ``*_reference`` and a ``*_triton``
(:mod:`kvzoo.kernels.dispatch` picks); no intermediate exceeds a scan's output or :data:`ROW_BLOCK_ELEMENTS`.
"""

from __future__ import annotations

import functools

import torch

from kvzoo.kernels.dispatch import mode, run, use_triton

# Relative slack added to every bound so that fp32 rounding can never make it undercut the exact
# fp32 score (the bound is exact arithmetic's; the slack is ~100x fp32's epsilon).
SKETCH_SLACK = 1e-5
# Most elements of an fp32 copy of index or archive rows made at once (rows are upcast in blocks).
ROW_BLOCK_ELEMENTS = 1 << 22


def _row_blocks(total: int, per_row: int) -> list[tuple[int, int]]:
    step = max(1, ROW_BLOCK_ELEMENTS // max(1, per_row))
    return [(start, min(start + step, total)) for start in range(0, total, step)]


def _upcast_matmul(query_rows: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``query_rows [B, G, hq, W]`` (fp32) times ``rows [B, G, m, W]`` (any dtype) transposed: ``[B, G, hq, m]`` fp32,
    the rows upcast in blocks of :data:`ROW_BLOCK_ELEMENTS` (never an fp32 copy of them all)."""
    B, G, hq, W = query_rows.shape
    m = rows.shape[2]
    out = query_rows.new_empty(B, G, hq, m)
    for start, stop in _row_blocks(m, B * G * W):
        out[..., start:stop] = torch.matmul(query_rows, rows[:, :, start:stop].float().transpose(-1, -2))
    return out


def _check(op: str, query_rows: torch.Tensor, entries: torch.Tensor, length: torch.Tensor | None,
           threshold: torch.Tensor | None = None) -> None:
    """A clear error for arguments the scans cannot take (the shapes and dtypes that are valid)."""
    if not isinstance(query_rows, torch.Tensor) or not isinstance(entries, torch.Tensor):
        raise TypeError(f"{op}: query_rows and entries must be tensors, got {type(query_rows).__name__} and "
                        f"{type(entries).__name__}")
    if query_rows.dim() != 4 or entries.dim() != 4:
        raise ValueError(f"{op}: query_rows must be [B, G, hq, W] and entries [B, G, m, W], got shapes "
                         f"{tuple(query_rows.shape)} and {tuple(entries.shape)}")
    if not query_rows.is_floating_point() or not entries.is_floating_point():
        raise TypeError(f"{op}: query_rows and entries must be floating point (fp32 query rows; entries fp32, "
                        f"fp16 or bf16), got {query_rows.dtype} and {entries.dtype}")
    B, G, hq, W = query_rows.shape
    if (entries.shape[0], entries.shape[1], entries.shape[3]) != (B, G, W):
        raise ValueError(f"{op}: entries must be [B, G, m, W] = [{B}, {G}, m, {W}] for query_rows "
                         f"{tuple(query_rows.shape)}, got {tuple(entries.shape)}")
    if entries.device != query_rows.device:
        raise ValueError(f"{op}: query_rows ({query_rows.device}) and entries ({entries.device}) must be on one device")
    if length is not None:
        if not isinstance(length, torch.Tensor) or length.dtype not in (torch.int32, torch.int64) \
                or tuple(length.shape) != (B,) or length.device != entries.device:
            described = (f"{length.dtype} {tuple(length.shape)} on {length.device}" if isinstance(length, torch.Tensor)
                         else type(length).__name__)
            raise ValueError(f"{op}: length must be None or an int32/int64 tensor [B] = [{B}] on {entries.device} "
                             f"(rows valid per sequence), got {described}")
    if threshold is not None:
        if not isinstance(threshold, torch.Tensor) or not threshold.is_floating_point() \
                or tuple(threshold.shape) != (B, G, hq) or threshold.device != entries.device:
            described = (f"{threshold.dtype} {tuple(threshold.shape)} on {threshold.device}"
                         if isinstance(threshold, torch.Tensor) else type(threshold).__name__)
            raise ValueError(f"{op}: threshold must be None or a float tensor [B, G, hq] = [{B}, {G}, {hq}] on "
                             f"{entries.device}, got {described}")


def _beyond(length: torch.Tensor, m: int) -> torch.Tensor:
    """Bool ``[B, 1, m]``: entry positions at or past each sequence's ``length``."""
    return torch.arange(m, device=length.device) >= length.view(-1, 1, 1)


def index_scan_reference(query_rows: torch.Tensor, entries: torch.Tensor, scaling: float, *,
                         length: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`index_scan` in PyTorch (the specification of the Triton kernel)."""
    m = entries.shape[2]
    q = query_rows.float()
    out = torch.matmul(q, entries.transpose(-1, -2)) if entries.dtype == torch.float32 else _upcast_matmul(q, entries)
    out.mul_(scaling)
    if length is not None:
        out.masked_fill_(_beyond(length, m)[:, :, None], float("-inf"))
    return out


def index_scan(query_rows: torch.Tensor, entries: torch.Tensor, scaling: float, *,
               length: torch.Tensor | None = None) -> torch.Tensor:
    """``scale * Q @ E^T`` ``[B, G, hq, m]`` fp32 for ``Q [B, G, hq, W]`` (fp32) and ``E [B, G, m, W]``.

    ``E`` in any float dtype is upcast in blocks of rows (the kernel: per tile, in registers), so the product is
    IEEE fp32's (not TF32: the slack column is 1e-5). ``length [B]`` (int32/int64, on the entries' device): positions
    ``>= length[b]`` give ``-inf`` and are never read, so a preallocated buffer may be passed whole."""
    _check("index_scan", query_rows, entries, length)
    if use_triton(entries):
        return run("index_scan", index_scan_triton, index_scan_reference, query_rows, entries, scaling, length=length)
    return index_scan_reference(query_rows, entries, scaling, length=length)


def _margin(bound: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """``bound - threshold`` with the sign of ``bound >= threshold`` made exact (see :func:`index_scan_reduce`)."""
    diff = bound - threshold
    return torch.where(bound >= threshold, torch.where(diff > 0, diff, 0.0),
                       torch.where(bound < threshold, diff, float("-inf")))


def index_scan_reduce_reference(query_rows: torch.Tensor, entries: torch.Tensor, scaling: float,
                                threshold: torch.Tensor | None, *, length: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`index_scan_reduce` in PyTorch. The bounds are :func:`index_scan_reference`'s, computed as one
    scan (so the selection is bit for bit today's ``(bounds >= threshold).any``), then reduced in blocks
    of rows; the kernel never holds them."""
    B, G, hq, W = query_rows.shape
    m = entries.shape[2]
    margin = query_rows.new_full((B, G, m), float("-inf"), dtype=torch.float32)
    if hq == 0:
        return margin
    thr = threshold.float()[..., None] if threshold is not None else 0.0
    bound = index_scan_reference(query_rows, entries, scaling, length=length)
    for start, stop in _row_blocks(m, B * G * hq):
        margin[..., start:stop] = _margin(bound[..., start:stop], thr).amax(dim=2)
    if length is not None:  # not rows at all: -inf whatever the threshold (even -inf)
        margin.masked_fill_(_beyond(length, m), float("-inf"))
    return margin


def index_scan_reduce(query_rows: torch.Tensor, entries: torch.Tensor, scaling: float,
                      threshold: torch.Tensor | None, *, length: torch.Tensor | None = None) -> torch.Tensor:
    """``margin [B, G, m]`` fp32: the max over the ``hq`` query rows of ``scale * Q.E - threshold``, without the
    ``[B, G, hq, m]`` bounds ever existing (VestigeKV's certified rule, Quest's ``gqa="group"``).

    ``threshold [B, G, hq]``, or None for 0 (the group's max bound). A margin is ``>= 0`` exactly when ``bound >=
    threshold`` for some query row, infinities included, and ``-inf`` when no query row can be compared with it (a
    NaN bound: an empty Quest page) and at positions ``>= length[b]``."""
    _check("index_scan_reduce", query_rows, entries, length, threshold)
    if use_triton(entries):
        return run("index_scan_reduce", index_scan_reduce_triton, index_scan_reduce_reference, query_rows, entries,
                   scaling, threshold, length=length)
    return index_scan_reduce_reference(query_rows, entries, scaling, threshold, length=length)


def _grouped(query: torch.Tensor, groups: int) -> torch.Tensor:
    """``[B, H, q, D]`` -> ``[B, G, hpg * q, D]`` fp32: a group's heads and queries share its rows."""
    B, H, q_len, D = query.shape
    return query.float().reshape(B, groups, (H // groups) * q_len, D)


def sketch_entries(content: torch.Tensor, branch: torch.Tensor | None, basis: torch.Tensor) -> torch.Tensor:
    """Index rows ``E = [z, eta, r, ||c||, ||r||]`` ``[B, G, m, rank + 1 + dr + 2]`` fp32 (``branch`` None: ``[z,
    eta, ||c||]``) for ``content [B,G,m,dc]`` (MLA's latent, GQA's key) and ``basis [B|1, G, dc, rank]`` orthonormal:
    ``z = V^T c``, ``eta = ||(I - V V^T) c||``."""
    V = basis.float() if basis.dim() == 4 else basis.float()[None]
    c = content.float()
    z = torch.matmul(c, V)
    eta = (c - torch.matmul(z, V.transpose(-1, -2))).norm(dim=-1, keepdim=True)
    parts = [z, eta]
    if branch is not None:
        r = branch.float()
        parts += [r, c.norm(dim=-1, keepdim=True), r.norm(dim=-1, keepdim=True)]
    else:
        parts.append(c.norm(dim=-1, keepdim=True))
    return torch.cat(parts, dim=-1)


def sketch_query(q_content: torch.Tensor, q_branch: torch.Tensor | None, basis: torch.Tensor, *,
                 slack: float = SKETCH_SLACK) -> torch.Tensor:
    """Query rows ``Q = [V^T q_c, ||(I - V V^T) q_c||, q_r, eps ||q_c||, eps ||q_r||]`` ``[B, G, hpg*q, W]``.

    ``Q . E = <q_r, r> + <V^T q_c, z> + ||q_perp|| eta + eps (||q_c|| ||c|| + ||q_r|| ||r||)``: the certified bound
    (Cauchy-Schwarz outside span(V)) plus the slack ``eps`` that covers fp32 rounding (fp16 entries:
    :data:`SKETCH_SLACK_FP16`)."""
    V = basis.float() if basis.dim() == 4 else basis.float()[None]
    G = V.shape[1]
    qc = _grouped(q_content, G)
    qz = torch.matmul(qc, V)
    resid = (qc - torch.matmul(qz, V.transpose(-1, -2))).norm(dim=-1, keepdim=True)
    parts = [qz, resid]
    if q_branch is not None:
        qr = _grouped(q_branch, G)
        parts += [qr, slack * qc.norm(dim=-1, keepdim=True), slack * qr.norm(dim=-1, keepdim=True)]
    else:
        parts.append(slack * qc.norm(dim=-1, keepdim=True))
    return torch.cat(parts, dim=-1)


# fp16 entries: each value stored to nearest carries a relative error <= 2^-11 (normal numbers; subnormals an absolute
# error <= 2^-25), so <q_z, z - z16> <= ||q_c|| (2^-11 ||z|| + sqrt(rank) 2^-25); the norm columns are stored rounded up
# after adding sqrt(width) 2^-14 (so 2^-11 times them covers the subnormal term) and the query's slack columns use
# SKETCH_SLACK + 2^-11 (+ a hair): the bound stays >= the exact score.
SKETCH_SLACK_FP16 = SKETCH_SLACK + 2.0 ** -11 * 1.001


def _round_up_fp16(x: torch.Tensor) -> torch.Tensor:
    """``x`` (fp32) in fp16, never below ``x``."""
    h = x.half()
    return torch.where(h.float() < x, torch.nextafter(h, torch.full_like(h, float("inf"))), h)


def round_entries_fp16(entries: torch.Tensor, rank: int, branch_dim: int) -> torch.Tensor:
    """Sketch entries stored in fp16 so that bounds with :data:`SKETCH_SLACK_FP16` stay certified: ``z`` and ``r`` to
    nearest, ``eta`` and the norms rounded up (the norms after adding ``sqrt(width) 2^-14``). Raises if a value
    overflows fp16; the check reads the device once per call."""
    out = entries.half()
    out[..., rank] = _round_up_fp16(entries[..., rank])  # eta
    norms = [(rank + 1 + branch_dim, rank)]  # ||c||: its column and the width whose rounding it covers
    if branch_dim:
        norms.append((rank + 2 + branch_dim, branch_dim))  # ||r||
    for col, width in norms:
        out[..., col] = _round_up_fp16(entries[..., col] + width ** 0.5 * 2.0 ** -14)
    if not bool(torch.isfinite(out).all()):
        raise ValueError("sketch entries overflow fp16 (|value| > 65504): use entry_dtype='float32'")
    return out


INT8_NORM_MARGIN = 1e-3  # relative margin on the stored error and norm columns of int8 key entries


def int8_key_entries(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row int8 keys for a certified bound: ``(codes [B, G, m, D] int8, side [B, G, m, 3] fp16)``, ``D + 6``
    bytes per row. ``side = [s, err, norm]``: the scale ``s`` (fp16, rounded up from ``max|k| / 127``), so ``k_hat = s *
    codes`` is exact in fp32; ``err >= ||k - k_hat||`` and ``norm >= max(||k||, ||k_hat||)``, widened by
    :data:`INT8_NORM_MARGIN` and rounded up. Then ``<q, k> <= s <q, codes> + ||q|| err`` (Cauchy-Schwarz)."""
    k = keys.float()
    scale = _round_up_fp16((k.abs().amax(-1) / 127).clamp(min=2.0 ** -14, max=65504.0))  # finite: codes stay finite
    codes = (k / scale.float()[..., None]).round().clamp(-127, 127)
    k_hat = codes * scale.float()[..., None]
    grow = 1 + INT8_NORM_MARGIN
    err = _round_up_fp16((k - k_hat).norm(dim=-1) * grow + 2.0 ** -24)
    norm = _round_up_fp16(torch.maximum(k.norm(dim=-1), k_hat.norm(dim=-1)) * grow)
    # no host check (rows are indexed inside decode steps): a norm past fp16's range rounds up to +inf, which
    # leaves that row's bound +inf -- still an upper bound
    return codes.to(torch.int8), torch.stack([scale, err, norm], dim=-1)


def int8_key_estimate_reference(query: torch.Tensor, codes: torch.Tensor, side: torch.Tensor, scaling: float, *,
                                length: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`int8_key_estimate` in PyTorch (the specification of the CPU kernel): the codes upcast in blocks of
    rows (:func:`_upcast_matmul`, never an fp32 copy of the whole index), then ``(dot * s) * scaling``."""
    m = codes.shape[2]
    estimate = _upcast_matmul(query.float(), codes).mul_(side[..., 0].float()[:, :, None]).mul_(scaling)
    if length is not None:
        estimate.masked_fill_(_beyond(length, m)[:, :, None], float("-inf"))
    return estimate


def int8_key_estimate(query: torch.Tensor, codes: torch.Tensor, side: torch.Tensor, scaling: float, *,
                      length: torch.Tensor | None = None) -> torch.Tensor:
    """``estimate [B, G, hq, m]`` fp32 ``= scaling * s <q, codes>`` (the score of each row's int8 reconstruction
    ``k_hat``) for grouped queries ``query [B, G, hq, D]`` over int8 key entries (:func:`int8_key_entries`);
    ``length [B]``: positions ``>= length[b]`` give ``-inf``. On CPU tensors the C loop of
    :mod:`kvzoo.kernels.cpu_native` (one read of the codes), elsewhere :func:`int8_key_estimate_reference`; the two
    agree to fp32 rounding, which the bound's slack covers (:func:`int8_bound_from`)."""
    from kvzoo.kernels import cpu_native

    if mode() != "torch" and cpu_native.int8_estimate_supported(query, codes, side):
        return cpu_native.int8_estimate(query, codes, side, scaling, length)
    return int8_key_estimate_reference(query, codes, side, scaling, length=length)


def unique_candidates(rows: torch.Tensor, ok: torch.Tensor, archived: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Candidates ``[B, G, K]`` with each chosen row kept once: sorted indices and a picked flag (the form a
    fused choice returns itself). ``O(K log K)`` in the candidates, independent of the archive."""
    idx = torch.where(ok, rows, archived).sort(dim=-1).values
    picked = idx < archived
    picked[..., 1:] &= idx[..., 1:] != idx[..., :-1]
    return idx.clamp_(max=archived - 1), picked


def count_picked(picked: torch.Tensor, counter: torch.Tensor | None) -> torch.Tensor:
    count = picked.sum()
    if counter is not None:
        counter.add_(count)
    return count


def page_rows_live(page_live: torch.Tensor, page_rows: int, m: int,
                   shift: torch.Tensor | None = None) -> torch.Tensor:
    """Bool ``[B, G, m]``: row ``i``'s page (``i // page_rows``; with ``shift [B, G]``, ``(i + shift) // page_rows``:
    pages from each sequence's first real row) is live in ``page_live [B, G, p]``."""
    rows = torch.arange(m, device=page_live.device)
    if shift is None:
        return page_live.index_select(2, torch.div(rows, page_rows, rounding_mode="floor"))
    page = torch.div(rows + shift[..., None], page_rows, rounding_mode="floor").clamp(max=page_live.shape[2] - 1)
    return page_live.gather(2, page)


def _check_valid(op: str, valid: torch.Tensor, B: int, G: int, m: int) -> None:
    """A scan's row flags: a bool tensor ``[B, G, >= m]`` (a fixed index's whole buffer) on the entries' device."""
    if not isinstance(valid, torch.Tensor) or valid.dtype != torch.bool or valid.dim() != 3 \
            or tuple(valid.shape[:2]) != (B, G) or valid.shape[2] < m:
        got = f"{valid.dtype} {tuple(valid.shape)}" if isinstance(valid, torch.Tensor) else type(valid).__name__
        raise ValueError(f"{op}: valid must be None or a bool tensor [B={B}, G={G}, >= m={m}] (False: a padding "
                         f"row, never chosen), got {got}")


def _check_pages(codes: torch.Tensor, page_live: torch.Tensor | None, page_rows: int) -> None:
    """The pruning arguments of :func:`int8_choose` (what the C op checks, said the same way)."""
    if page_live is None:
        if page_rows:
            raise ValueError(f"int8_choose: page_rows={page_rows} without page_live: pass both (pruning) or neither")
        return
    B, G, m = codes.shape[:3]
    if isinstance(page_rows, bool) or not isinstance(page_rows, int) or page_rows < 1:
        raise ValueError(f"int8_choose: page_rows must be an int >= 1 (archived rows a page flag covers), "
                         f"got {page_rows!r}")
    pages = -(-m // page_rows)
    if not isinstance(page_live, torch.Tensor) or page_live.dtype != torch.bool or page_live.dim() != 3 \
            or tuple(page_live.shape[:2]) != (B, G) or page_live.shape[2] < pages:
        got = (f"{page_live.dtype} {tuple(page_live.shape)}" if isinstance(page_live, torch.Tensor)
               else type(page_live).__name__)
        raise ValueError(f"int8_choose: page_live must be a bool tensor [B={B}, G={G}, p >= ceil(m / page_rows) = "
                         f"{pages}] (a flag for every page of m={m} rows), got {got}")


def int8_choose_reference(query: torch.Tensor, codes: torch.Tensor, side: torch.Tensor, threshold: torch.Tensor,
                          j: int, archived: int, scaling: float, *, length: torch.Tensor | None = None,
                          counter: torch.Tensor | None = None, page_live: torch.Tensor | None = None,
                          page_rows: int = 0,
                          scanned: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`int8_choose` in PyTorch: :func:`int8_key_estimate_reference`, each query row's top ``j``, their
    bounds (:func:`int8_bound_from`) against ``threshold``, then the group's union staged as the runtime stages a
    choice (sorted candidates, the unchosen ones ``archived``, each chosen row flagged once) and counted. With
    ``page_live``, the rows of dead pages get estimate ``-inf`` (never kept: their bound is ``-inf`` too); this
    reference still reads their codes, and counts into ``scanned`` the bytes the C op reads (the live pages' rows)."""
    B, G, hq, _ = query.shape
    _check_pages(codes, page_live, page_rows)
    m = codes.shape[2]
    estimate = int8_key_estimate_reference(query, codes, side, scaling, length=length)
    if page_live is not None:
        read = page_rows_live(page_live, page_rows, m)  # [B, G, m]
        estimate.masked_fill_(~read[:, :, None], float("-inf"))
        if scanned is not None:
            if length is not None:
                read = read & ~_beyond(length, m)
            scanned.add_(read.sum() * (codes.shape[3] + 2 * side.shape[3]))
    elif scanned is not None:
        live = length.clamp(0, m).sum() * G if length is not None else B * G * m
        scanned.add_(live * (codes.shape[3] + 2 * side.shape[3]))
    top, rows = estimate.topk(j, dim=-1)  # [B, G, hq, j]
    w = side.shape[-1]
    picked_side = side[:, :, None].expand(B, G, hq, side.shape[2], w).gather(3, rows[..., None].expand(B, G, hq, j, w))
    ok = int8_bound_from(top, query, picked_side, scaling) > threshold[..., None]
    idx, picked = unique_candidates(rows.view(B, G, hq * j), ok.view(B, G, hq * j), archived)
    return idx, picked, count_picked(picked, counter)


def fused_choose_applies(query: torch.Tensor, codes: torch.Tensor, side: torch.Tensor, j: int,
                         counter: torch.Tensor | None = None, page_live: torch.Tensor | None = None,
                         scanned: torch.Tensor | None = None) -> bool:
    """Whether :func:`int8_choose` runs as one kernel call for these tensors (``KVZOO_KERNELS`` not ``torch``, and
    :func:`kvzoo.kernels.cpu_native.int8_estimate_supported` with ``j``, the counters and the page flags: one
    predicate per step)."""
    from kvzoo.kernels import cpu_native

    return mode() != "torch" and cpu_native.int8_estimate_supported(query, codes, side, j, counter, page_live, scanned)


def int8_choose(query: torch.Tensor, codes: torch.Tensor, side: torch.Tensor, threshold: torch.Tensor, j: int,
                archived: int, scaling: float, *, length: torch.Tensor | None = None,
                counter: torch.Tensor | None = None, page_live: torch.Tensor | None = None, page_rows: int = 0,
                scanned: torch.Tensor | None = None, valid: torch.Tensor | None = None,
                page_shift: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """VestigeKV's top-j rule over int8 key entries, staged and counted: ``(idx, picked) [B, G, hq * j]``, ``count``.

    Per query row its top ``j`` rows by :func:`int8_key_estimate`, each kept where its certified bound
    (:func:`int8_bound_from`) is above ``threshold [B, G, hq]`` (``s* - j_margin``); the group's candidates staged as
    :func:`unique_candidates` stages them; ``count`` added to ``counter`` in place when given. On CPU one call of the C
    loop (:func:`fused_choose_applies`), elsewhere :func:`int8_choose_reference`; they agree up to fp32 rounding of
    the estimates (a bound within rounding of its threshold may go either way).

    Pruning: ``page_live [B, G, p]`` bool and ``page_rows`` (row ``i`` is in page ``i // page_rows``; ``p >= ceil(m /
    page_rows)``): the rows of a page flagged False are left out (the C loop never reads their codes), so the choice is
    the rule's over the live pages' rows (:func:`int8_page_live` flags the pages that may hold a row above the
    threshold). ``scanned`` (int64, one element): ``+=`` the bytes of the entries the C loop reads, ``D + 2 w`` a row
    (the live pages' rows below ``length``; the reference counts the same, though it reads every row).

    ``valid [B, G, >= m]`` bool (None: every row is one): a row flagged False (padding) is left out as a dead page's
    rows are -- never read, never ranked, never kept -- the flags taken as pages of one row (with ``page_live``, its
    pages' flags spread over their rows and joined to them; ``page_shift [B, G]``: pages from each sequence's first
    real row, :func:`page_rows_live`)."""
    from kvzoo.kernels import cpu_native

    if page_shift is not None and valid is None:
        raise ValueError("int8_choose: page_shift (pages from each sequence's first real row) comes with valid (the "
                         "padding it skips): pass both or neither")
    if valid is not None:
        m = codes.shape[2]
        _check_valid("int8_choose", valid, codes.shape[0], codes.shape[1], m)
        rows_live = valid[:, :, :m]
        if page_live is not None:
            _check_pages(codes, page_live, page_rows)
            rows_live = rows_live & page_rows_live(page_live, page_rows, m, page_shift)
        page_live, page_rows = rows_live, 1
    if fused_choose_applies(query, codes, side, j, counter, page_live, scanned):
        return cpu_native.int8_choose(query, codes, side, threshold, j, archived, scaling, SKETCH_SLACK, length,
                                      counter, page_live, page_rows, scanned)
    return int8_choose_reference(query, codes, side, threshold, j, archived, scaling, length=length, counter=counter,
                                 page_live=page_live, page_rows=page_rows, scanned=scanned)


def int8_bound_from(estimate: torch.Tensor, query: torch.Tensor, side: torch.Tensor, scaling: float) -> torch.Tensor:
    """The certified bound ``estimate + scaling ||q|| (err + eps norm) >= scaling <q, k>`` from an estimate
    ``[B, G, hq, n]`` and the ``side`` columns ``[scale, err, norm]`` of the same rows, broadcast against it
    (``[B, G, 1, n, 3]`` for every row, or ``[B, G, hq, n, 3]`` gathered per query row): for a few chosen rows
    it costs a few numbers, not a pass over the index."""
    side = side.float()
    qn = query.float().norm(dim=-1, keepdim=True)  # [B, G, hq, 1]
    return estimate + scaling * qn * (side[..., 1] + SKETCH_SLACK * side[..., 2])


def int8_key_bounds(query: torch.Tensor, codes: torch.Tensor, side: torch.Tensor, scaling: float, *,
                    length: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(bound, estimate)`` ``[B, G, hq, m]`` fp32 for grouped queries ``query [B, G, hq, D]`` over int8 key entries:
    :func:`int8_key_estimate` and :func:`int8_bound_from`. ``length [B]``: positions ``>= length[b]`` give ``-inf``."""
    estimate = int8_key_estimate(query, codes, side, scaling, length=length)
    bound = int8_bound_from(estimate, query, side[:, :, None], scaling)
    if length is not None:  # past length the side columns are anything (an fp16 norm's inf): -inf + inf is NaN
        bound.masked_fill_(_beyond(length, codes.shape[2])[:, :, None], float("-inf"))
    return bound, estimate


def int8_row_bounds(query: torch.Tensor, codes: torch.Tensor, side: torch.Tensor,
                    scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`int8_key_bounds` for rows gathered per query row (``codes [B, G, hq, K, D]``, ``side [B, G, hq, K, 3]``
    -> ``[B, G, hq, K]``): the second stage of a paged scan (:func:`int8_page_bounds` picks the pages)."""
    q = query.float()
    estimate = torch.matmul(codes.float(), q[..., None])[..., 0].mul_(side[..., 0].float()).mul_(scaling)
    return int8_bound_from(estimate, q, side, scaling), estimate  # [B, G, hq, K]


# Relative slack of a page bound (its codes' products summed in fp32, and the exact fp32 score it is audited
# against, each err at most ~128 * 2^-24 of sum |q_i| 128 s): twice the sketch's.
PAGE_SLACK = 2 * SKETCH_SLACK


def _round_up_16_bits(x: torch.Tensor) -> torch.Tensor:
    """Positive fp32 ``x`` rounded up to 16 significant bits (the low 8 mantissa bits cleared, carrying up);
    ``+inf`` stays ``+inf``."""
    bits = x.contiguous().view(torch.int32)
    rounded = ((bits + 0xFF) & ~0xFF).view(torch.float32)
    return torch.where(torch.isfinite(x), rounded, x)


def int8_page_entries(page_min: torch.Tensor, page_max: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A coarse page summary in int8, ``2 D + 4`` bytes a page: ``(codes [B, G, p, 2 D] int8, scale [B, G, p]
    fp32)`` from each page's key min and max ``[B, G, p, D]`` (an empty page's ``+inf`` / ``-inf``: codes 0). ``scale``
    (``max |k| / 127``, widened, rounded up to 16 significant bits: a code times it is exact in fp32) and ``codes =
    [ceil(max / scale), floor(min / scale)]`` corrected where fp32 rounded inward, so ``scale * codes[:D] >= max`` and
    ``scale * codes[D:] <= min`` exactly; a page with an infinite key gets an infinite scale (its bound ``+inf``)."""
    empty = torch.isinf(page_min).all(-1, keepdim=True) & torch.isinf(page_max).all(-1, keepdim=True)
    lo = page_min.float().masked_fill(empty, 0.0)
    hi = page_max.float().masked_fill(empty, 0.0)
    amax = torch.maximum(lo.abs(), hi.abs()).amax(-1)
    scale = _round_up_16_bits((amax / 127 * (1 + 2.0 ** -20)).clamp(min=2.0 ** -14))
    finite = torch.isfinite(scale)
    s = torch.where(finite, scale, 1.0)[..., None]  # an infinite page's codes are not used
    up = torch.ceil(hi / s)
    up = torch.where(up * s < hi, up + 1, up)
    down = torch.floor(lo / s)
    down = torch.where(down * s > lo, down - 1, down)
    codes = torch.cat([up, down], dim=-1).nan_to_num_(0.0).clamp_(-128, 127).to(torch.int8)
    return codes, scale


def int8_page_bounds(query: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, scaling: float, *,
                     length: torch.Tensor | None = None) -> torch.Tensor:
    """Quest's page bound on an int8 page summary (:func:`int8_page_entries`): ``[B, G, hq, p]`` fp32, ``scale (sum_i
    max(q_i, 0) hi_i + min(q_i, 0) lo_i + slack) >= <q, k>`` for every key of the page (``scale lo_i <= k_i <= scale
    hi_i``); the slack (:data:`PAGE_SLACK` ``* 128 ||q||_1``) covers fp32's rounding. Pages ``>= length[b]`` give
    ``-inf``, a page of infinite scale ``+inf``."""
    p = codes.shape[2]
    q = query.float()
    dot = _upcast_matmul(torch.cat([q.clamp(min=0), q.clamp(max=0)], dim=-1), codes)  # [q+, q-] . [hi, lo]
    dot.add_(PAGE_SLACK * 128 * q.abs().sum(-1, keepdim=True))
    finite = torch.isfinite(scale)
    bound = dot.mul_(torch.where(finite, scale, 1.0)[:, :, None]).mul_(scaling)
    bound.masked_fill_(~finite[:, :, None], float("inf"))
    if length is not None:
        bound.masked_fill_(_beyond(length, p)[:, :, None], float("-inf"))
    return bound


def int8_page_live(query: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, empty: torch.Tensor,
                   threshold: torch.Tensor, scaling: float, *, length: torch.Tensor | None = None) -> torch.Tensor:
    """Pruning's page flags, bool ``[B, G, p]``: a page is dead (False) when its bound (:func:`int8_page_bounds`, on
    the page summary's ``codes``/``scale``, ``>=`` the score of every key of the page) is ``<= threshold [B, G, hq]``
    for every query row of its group -- then no row of the page scores above the threshold -- or when it holds no
    row (``empty``, and pages ``>= length[b]``). A NaN bound or threshold leaves the page live. On CPU tensors one
    call of the C loop (:mod:`kvzoo.kernels.cpu_native`), elsewhere :func:`int8_page_live_reference`; they agree up
    to fp32 rounding of the dots, which :data:`PAGE_SLACK` covers either way (a bound within rounding of its
    threshold may go either way; both are certified)."""
    from kvzoo.kernels import cpu_native

    if mode() != "torch" and cpu_native.int8_page_live_supported(query, codes, scale, empty, threshold):
        return cpu_native.int8_page_live(query, codes, scale, empty, threshold, scaling, PAGE_SLACK * 128, length)
    return int8_page_live_reference(query, codes, scale, empty, threshold, scaling, length=length)


def int8_page_live_reference(query: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, empty: torch.Tensor,
                             threshold: torch.Tensor, scaling: float, *,
                             length: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`int8_page_live` in PyTorch (the specification of the C loop)."""
    bounds = int8_page_bounds(query, codes, scale, scaling, length=length)  # [B, G, hq, p]
    dead = (bounds <= threshold.float()[..., None]).all(2) | empty
    if length is not None:
        dead |= _beyond(length, codes.shape[2])
    return dead.logical_not_()


def page_entries(page_min: torch.Tensor, page_max: torch.Tensor) -> torch.Tensor:
    """Index rows ``E = [max, min, max_i max(|min_i|, |max_i|)]`` ``[B, G, p, 2 D + 1]`` in the input dtype (each
    one of the page's key values: exact)."""
    magnitude = torch.maximum(page_min.abs(), page_max.abs()).amax(dim=-1, keepdim=True)
    return torch.cat([page_max, page_min, magnitude], dim=-1)


def page_query(query: torch.Tensor, groups: int) -> torch.Tensor:
    """Query rows ``Q = [max(q, 0), min(q, 0), eps ||q||_1]`` ``[B, G, hpg * q, 2 D + 1]`` fp32: ``Q . E`` is Quest's
    bound ``sum_i max(q_i min_i, q_i max_i)`` (``min <= max``) plus a slack covering fp32 rounding."""
    q = _grouped(query, groups)
    return torch.cat([q.clamp(min=0), q.clamp(max=0), SKETCH_SLACK * q.abs().sum(-1, keepdim=True)], dim=-1)


def exact_scores(query: torch.Tensor, keys: torch.Tensor, scaling: float) -> torch.Tensor:
    """``scale * <q, k>`` ``[B, H, q, m]`` fp32 for rows ``keys [B, G, m, D]`` (audits and s*), the rows upcast in
    blocks so the product is fp32's whatever the cache dtype."""
    B, H, q_len, D = query.shape
    G, m = keys.shape[1], keys.shape[2]
    out = _upcast_matmul(_grouped(query, G), keys)
    return (scaling * out).view(B, H, q_len, m)


# ---------------------------------------------------------------------------------------------------
# The Triton kernel: one program per (tile of BLOCK_M entries, (b, g)); it holds all the group's query
# rows (BLOCK_Q at a time) and runs over W in BLOCK_W chunks, entries upcast to fp32 in registers and an
# fp32 (IEEE, not TF32) dot. The scan stores the bounds; the reduction keeps the running max margin.
# Triton is imported by _jit() on the first kernel call, never at module import.

tl = None  # triton.language, bound by _jit()

INDEX_SCAN_MAX_BLOCK_Q = 64  # query rows one program holds at once; more are taken in chunks
_TRITON_DTYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def _index_scan_kernel(
    q_ptr, e_ptr, thr_ptr, len_ptr, out_ptr, scaling,
    G, hq, m, W, stride_lb,
    stride_qb, stride_qg, stride_qh,
    stride_eb, stride_eg, stride_em,
    REDUCE: tl.constexpr, HAS_THRESHOLD: tl.constexpr, HAS_LENGTH: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_W: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bg = tl.program_id(1)
    b = pid_bg // G
    g = pid_bg - b * G
    n_rows = m
    if HAS_LENGTH:
        n_rows = tl.minimum(tl.load(len_ptr + b * stride_lb), m).to(tl.int32)
    local = tl.arange(0, BLOCK_M)
    rows = pid_m * BLOCK_M + local
    row_ok = rows < n_rows
    heads0 = tl.arange(0, BLOCK_Q)
    cols0 = tl.arange(0, BLOCK_W)
    q_base = q_ptr + b.to(tl.int64) * stride_qb + g.to(tl.int64) * stride_qg
    e_base = e_ptr + b.to(tl.int64) * stride_eb + g.to(tl.int64) * stride_eg + (pid_m * BLOCK_M).to(tl.int64) * stride_em
    best = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for h0 in range(0, hq, BLOCK_Q):
        heads = h0 + heads0
        head_ok = heads < hq
        acc = tl.zeros([BLOCK_Q, BLOCK_M], dtype=tl.float32)
        for w0 in range(0, W, BLOCK_W):
            cols = w0 + cols0
            col_ok = cols < W
            q = tl.load(q_base + heads[:, None] * stride_qh + cols[None, :],
                        mask=head_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
            e = tl.load(e_base + local[:, None] * stride_em + cols[None, :],
                        mask=row_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
            acc = tl.dot(q, tl.trans(e), acc, input_precision="ieee")
        bound = acc * scaling
        if REDUCE:
            if HAS_THRESHOLD:
                thr = tl.load(thr_ptr + pid_bg.to(tl.int64) * hq + heads, mask=head_ok, other=0.0)[:, None]
            else:
                thr = tl.zeros([BLOCK_Q, 1], dtype=tl.float32)
            # the sign follows bound >= thr exactly: the sm_90 PTX has no .ftz (a - b is 0 only when a == b),
            # and where bound - thr is fused into one fma the rounded comparison still decides
            diff = bound - thr
            margin = tl.where(bound >= thr, tl.where(diff > 0, diff, 0.0),
                              tl.where(bound < thr, diff, float("-inf")))
            margin = tl.where(head_ok[:, None], margin, float("-inf"))
            best = tl.maximum(best, tl.max(margin, axis=0))
        else:
            bound = tl.where(row_ok[None, :], bound, float("-inf"))
            out = out_ptr + (pid_bg.to(tl.int64) * hq + heads[:, None]) * m + rows[None, :]
            tl.store(out, bound, mask=head_ok[:, None] & (rows[None, :] < m))
    if REDUCE:
        best = tl.where(row_ok, best, float("-inf"))
        tl.store(out_ptr + pid_bg.to(tl.int64) * m + rows, best, mask=rows < m)


_INT_ARGS = ("G", "hq", "m", "W", "stride_lb", "stride_qb", "stride_qg", "stride_qh", "stride_eb", "stride_eg",
             "stride_em")
_POINTER_ARGS = ("q_ptr", "e_ptr", "thr_ptr", "len_ptr", "out_ptr")


@functools.cache
def _jit():
    """The jitted kernel (imports Triton). Integers and pointers are not specialised on their values or
    alignment, so the binary a GPU runs is the one ``kvzoo/kernels/shapes.py`` holds to the compile gate
    (rows of odd width are never 16-byte aligned anyway)."""
    global tl
    import triton
    import triton.language

    tl = triton.language
    return triton.jit(_index_scan_kernel, do_not_specialize=_INT_ARGS, do_not_specialize_on_alignment=_POINTER_ARGS)


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def launch_config(hq: int, W: int) -> dict[str, int]:
    """Block sizes, warps and stages of a scan over ``hq`` query rows of width ``W`` -- the one rule the
    launcher and ``kvzoo/kernels/shapes.py`` share. Every ``tl.dot`` dimension is >= 16."""
    # Measured with the compile gate (sm_90): Triton's fp32 (FMA) dot holds each thread's slice of both
    # operands over the whole BLOCK_W, so registers grow with BLOCK_M x BLOCK_W / threads. BLOCK_W 16, 8 warps
    # and no software pipelining (num_stages 1) keep every shipped shape at 56-102 registers with no stack;
    # BLOCK_W 32 with 4 warps took 190-255, and num_stages 2 up to 180 and a stack frame for 32-64 rows.
    # The scan is bandwidth-bound: occupancy (3-4 programs of 8 warps per SM) hides the loads' latency.
    block_q = min(max(16, _next_pow2(hq)), INDEX_SCAN_MAX_BLOCK_Q)
    # wide rows (Quest's MLA pages, 2 x 576 + 1) and more than 16 query rows: 32 entries per program, so that
    # the registers stay in budget and a short archive still spreads over the GPU's SMs (Triton 3.6, the GPU
    # machine's, gave the 32-row x 64-entry reduce with a length an 8-byte stack frame; 3.7.1 did not)
    block_m = 64 if W <= 256 and block_q <= 16 else 32
    return {"BLOCK_Q": block_q, "BLOCK_M": block_m, "BLOCK_W": 16, "num_warps": 8, "num_stages": 1}


def _launch(query_rows, entries, scaling, threshold, length, reduce: bool) -> torch.Tensor:
    B, G, hq, W = query_rows.shape
    m = entries.shape[2]
    q = query_rows.float()
    if q.stride(-1) != 1 and W > 1:
        q = q.contiguous()
    e = entries if entries.stride(-1) == 1 or W == 1 else entries.contiguous()
    if e.dtype not in _TRITON_DTYPES:
        raise TypeError(f"the Triton index scan takes entries in {sorted(str(d) for d in _TRITON_DTYPES)}, "
                        f"got {e.dtype} (KVZOO_KERNELS=torch takes any float dtype)")
    if reduce:
        out = torch.full((B, G, m), float("-inf"), dtype=torch.float32, device=e.device) if hq == 0 \
            else torch.empty((B, G, m), dtype=torch.float32, device=e.device)
    else:
        out = torch.empty((B, G, hq, m), dtype=torch.float32, device=e.device)
    if m == 0 or hq == 0 or B * G == 0:
        return out
    if B * G > 65535:
        raise ValueError(f"the Triton index scan takes B x G <= 65535 (one grid axis), got {B} x {G}")
    thr = threshold.float().contiguous() if threshold is not None else None
    config = launch_config(hq, W)
    warps, stages = config.pop("num_warps"), config.pop("num_stages")
    grid = (-(-m // config["BLOCK_M"]), B * G)
    # a count shared by every sequence (a fixed-capacity index: its [1] length expanded to [B]) has stride 0
    _jit()[grid](q, e, thr, length, out, float(scaling), G, hq, m, W, 0 if length is None else length.stride(0),
                 q.stride(0), q.stride(1), q.stride(2), e.stride(0), e.stride(1), e.stride(2),
                 REDUCE=reduce, HAS_THRESHOLD=thr is not None, HAS_LENGTH=length is not None,
                 num_warps=warps, num_stages=stages, **config)
    return out


def index_scan_triton(query_rows: torch.Tensor, entries: torch.Tensor, scaling: float, *,
                      length: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`index_scan` as one fused Triton kernel."""
    return _launch(query_rows, entries, scaling, None, length, reduce=False)


def index_scan_reduce_triton(query_rows: torch.Tensor, entries: torch.Tensor, scaling: float,
                             threshold: torch.Tensor | None, *, length: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`index_scan_reduce` as one fused Triton kernel (the bounds stay in registers)."""
    return _launch(query_rows, entries, scaling, threshold, length, reduce=True)
