"""Decode attention as Triton kernels: a split-K kernel per source and a one-pass log-sum-exp merge kernel, and the
launch heuristics the launcher and the compile gate share (``kvzoo/kernels/shapes.py`` lists what ships).

Per source one program per ``(batch x KV group, split)`` holds all the query heads of its group, so each row is loaded
once per group, and runs an online softmax over its share of the positions (cut from ``length`` in the program, so a
captured launch follows the true length); each split writes a partial ``(out, lse)`` and, asked, its best score (s*
with no second read of the rows). One merge kernel per source combines the splits exactly and folds in what came
before (the previous source, or a ``prior`` part). Flags are packed into int32 words per position
(:func:`_flag_words`) and, with the indices, loaded a tile ahead, so no row load waits on a load of its own
iteration. The kernels run on CUDA tensors, or on CPU under ``TRITON_INTERPRET=1``; Triton is imported on the first
launch (:func:`kernels`).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from kvzoo.kernels import dispatch
from kvzoo.kernels.decode_attention.rows import MAX_SPLITS, Attended, Rows, _Source, _validate

LOG2E = 1.4426950408889634
DEFAULT_SMS = 132  # H100 SXM / H200: the splits heuristic's SM count when the device has none to report
tl = None  # triton.language, bound by kernels() (the kernels below resolve it through this module's globals)

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
    """What the launcher picks for a source (and ``kvzoo/kernels/shapes.py`` compiles), measured on the sm_90 code
    (``tests/test_compile_gate.py`` holds every shipped configuration to it). A key row is a main part ``D1`` (the
    value width in the absorbed form, else the whole key) and a tail ``D2``, each a power-of-two block >= 16. A tile of
    ``8 x num_warps`` rows gives each warp its own ``mma.sync`` scores; 32 latent heads spill at 4 warps, so 8 warps
    with each score computed twice (``score_copies``); wgmma spills and is not used. Programs per SM: as many as shared
    memory allows, capped by a register budget the compiled code is held to (a ``maxnreg`` cap made ptxas spill)."""
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
    """The merge kernel's blocks for ``splits`` splits: every split's log-sum-exp in one tile (``BLOCK_S``, up to
    :data:`MAX_MERGE_BLOCK_S`; more are taken in chunks) and ``BLOCK_DV`` output columns, so one program loads at most
    4,096 partial outputs at once: one round trip to L2, no loop."""
    block_s = min(MAX_MERGE_BLOCK_S, _pow2(splits, 16))
    return MergeConfig(BLOCK_S=block_s, BLOCK_DV=max(4, min(128, 4096 // block_s)), num_warps=4, num_stages=1)


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return DEFAULT_SMS


def default_splits(batch_groups: int, positions: int, block_n: int, sms: int = DEFAULT_SMS,
                   ctas_per_sm: int = 2) -> int:
    """Splits per source when ``splits=None``: ``batch_groups x splits`` fills one wave of the ``sms x
    ctas_per_sm`` programs the chip holds at once, at most one split per tile of ``block_n`` positions, at least one."""
    tiles = -(-positions // block_n)
    return max(1, min(tiles, (sms * ctas_per_sm) // max(1, batch_groups), MAX_SPLITS))


# ----------------------------------------------------------------------------------------------------
# the kernels (plain functions here, jitted by kernels() on first use: triton is imported only there)
# ----------------------------------------------------------------------------------------------------


def _tile_rows(idx_base, ahead, hi, n_pool, stride_ik, GATHER: tl.constexpr):
    """The row number of each position of a tile (int32; -1: past the split or outside the pool)."""
    if GATHER:
        got = tl.load(idx_base + ahead.to(tl.int64) * stride_ik, mask=ahead < hi, other=-1)
        return tl.where((got >= 0) & (got < n_pool), got, -1).to(tl.int32)
    return tl.where(ahead < hi, ahead, -1)


def _flag_word(flag_base, ahead, hi, stride_fw, FLAG_WORDS: tl.constexpr):
    """The OR of a tile's flag words per position: nonzero where some head of the group may read it."""
    word = tl.load(flag_base + ahead, mask=ahead < hi, other=0)
    for w in tl.static_range(1, FLAG_WORDS):
        word = word | tl.load(flag_base + w * stride_fw + ahead, mask=ahead < hi, other=0)
    return word


def _heads_allowed(word, fetch, flag_base, pos, stride_fw, offs_h, FLAG_WORDS: tl.constexpr, BLOCK_H: tl.constexpr,
                   BLOCK_N: tl.constexpr):
    """``[BLOCK_H, BLOCK_N]`` bool: which head may read which position. valid and head_valid in int32 words: bit j
    of word w = head 32 w + j may read the position."""
    if FLAG_WORDS == 1:
        head_ok = (word[None, :] >> (offs_h % 32)[:, None]) & 1
    else:  # exactly the words the host packed (ceil(hpg / 32)); heads past them read nothing. These loads only mask
        # the scores, so they need not come a tile ahead
        head_ok = tl.zeros([BLOCK_H, BLOCK_N], tl.int32)
        for w in tl.static_range(FLAG_WORDS):
            bits = tl.load(flag_base + w * stride_fw + pos, mask=fetch, other=0)
            bit = (bits[None, :] >> (offs_h % 32)[:, None]) & 1
            head_ok = tl.where((offs_h // 32 == w)[:, None], bit, head_ok)
    return head_ok != 0


def decode_split_kernel(
    Q, K, V, LENGTH, IDX, FLAGS, PART_O, PART_L, PART_M,
    scale_log2,
    n_pool, n_pos, stride_lb,
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
        n = tl.maximum(tl.minimum(tl.load(LENGTH + b * stride_lb).to(tl.int32), n_pos), 0)
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
    rows_next = _tile_rows(idx_base, ahead, hi, n_pool, stride_ik, GATHER)
    if HAS_FLAGS:
        word_next = _flag_word(flag_base, ahead, hi, stride_fw, FLAG_WORDS)
        rows_next = tl.where(word_next != 0, rows_next, -1)
    for start in range(lo, hi, BLOCK_N):
        rows = rows_next
        if HAS_FLAGS:
            word = word_next
        ahead = start + BLOCK_N + offs_n
        rows_next = _tile_rows(idx_base, ahead, hi, n_pool, stride_ik, GATHER)
        if HAS_FLAGS:
            word_next = _flag_word(flag_base, ahead, hi, stride_fw, FLAG_WORDS)
            rows_next = tl.where(word_next != 0, rows_next, -1)
        fetch = rows >= 0
        if HAS_FLAGS:
            allowed = fetch[None, :] & _heads_allowed(word, fetch, flag_base, start + offs_n, stride_fw, offs_h,
                                                      FLAG_WORDS, BLOCK_H, BLOCK_N)
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


def decode_merge_kernel(
    PART_O, PART_L, PART_M, LENGTH, PRIOR_O, PRIOR_L, PRIOR_M, OUT, LSE, BEST_OUT,
    heads, n_pos, stride_lb, splits, block_n, dv,
    BLOCK_S: tl.constexpr, BLOCK_DV: tl.constexpr, ONE_TILE: tl.constexpr,
    HAS_LENGTH: tl.constexpr, HAS_PRIOR: tl.constexpr, BEST: tl.constexpr, PRIOR_BEST: tl.constexpr,
):
    bh = tl.program_id(0).to(tl.int64)
    pid_d = tl.program_id(1)
    b = bh // heads
    # the splits that hold positions, as the split kernel cut them: [0, count)
    if HAS_LENGTH:
        n = tl.maximum(tl.minimum(tl.load(LENGTH + b * stride_lb).to(tl.int32), n_pos), 0)
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


@functools.cache
def kernels() -> SimpleNamespace:
    """The jitted split and merge kernels (imports Triton); their helpers are jitted in place (the kernels call
    them through this module's globals)."""
    global tl, _tile_rows, _flag_word, _heads_allowed
    import triton
    import triton.language

    tl = triton.language
    _tile_rows, _flag_word, _heads_allowed = (triton.jit(f) for f in (_tile_rows, _flag_word, _heads_allowed))
    return SimpleNamespace(split=triton.jit(decode_split_kernel), merge=triton.jit(decode_merge_kernel))


# ----------------------------------------------------------------------------------------------------
# the launcher
# ----------------------------------------------------------------------------------------------------


def _flag_words(valid: torch.Tensor | None, head_valid: torch.Tensor | None, hpg: int) -> torch.Tensor:
    """``valid [B, G, N']`` and ``head_valid [B, H, N']`` as the kernel reads them: int32 words ``[B, G, W, N']``
    (``W = ceil(hpg / 32)``, unit stride along ``N'``), bit ``j`` of word ``w`` set when head ``32 w + j`` of the
    group may read the position: one word per position, copied asynchronously like an index, so the kernel knows in
    time which rows not to load at all."""
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
    """Every pool 16-byte aligned with (batch, group, row) strides multiples of 16 elements: the kernel may tell
    the compiler so (vectorised, asynchronously pipelined row loads)."""
    return all(t.data_ptr() % 16 == 0 and all(st % 16 == 0 for st in t.stride()[:3]) for t in pools)


def _split_launch(query: torch.Tensor, s: _Source, splits: int | None,
                  tune: dict | None = None) -> tuple[SplitConfig, int]:
    """The configuration and split count for one source (``tune``: :class:`SplitConfig` fields replaced, for
    ``benchmarks/gpu_kernels.py``'s sweep)."""
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


def launch(query: torch.Tensor, checked: list[_Source], scaling: float, splits: int | None, *,
           best: bool = False, prior: tuple | None = None, out_dtype: torch.dtype | None = None,
           tune: dict | None = None, merge: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(out [B, H, Dv] in out_dtype (default: the query's), lse [B, H], best [B, H] or None)``: per source the
    split kernel, then the merge kernel, which folds in the previous source's result or ``prior = (out, lse)``. For
    the benchmark: ``tune`` (see :func:`_split_launch`); ``merge=False`` returns the last source's partials."""
    B, H, D = query.shape
    if query.device.type == "cpu" and dispatch.interpreting():
        if any(t.dtype == torch.bfloat16 for t in [query] + [s.rows.keys for s in checked]):
            raise ValueError("decode_attention's kernels in Triton's CPU interpreter: bfloat16 is computed "
                             "wrong there (float16 and float32 are right); test bfloat16 on a GPU or use "
                             "KVZOO_KERNELS=torch")
    jitted = kernels()
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
        jitted.split[(B * s.groups, count)](
            query, keys, values,
            src.length if src.length is not None else keys,
            src.indices if src.indices is not None else keys,
            flags if flags is not None else keys,
            part_o, part_l, part_m,
            float(scaling) * LOG2E,
            s.pool, s.positions, _length_stride(src.length),
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
        jitted.merge[(B * H, -(-Dv // mcfg.BLOCK_DV))](
            part_o, part_l, part_m,
            src.length if src.length is not None else part_l,
            p_out, p_lse, p_best if p_best is not None else lse,
            out, lse, top if top is not None else lse,
            H, s.positions, _length_stride(src.length), count, cfg.BLOCK_N, Dv,
            BLOCK_S=mcfg.BLOCK_S, BLOCK_DV=mcfg.BLOCK_DV, ONE_TILE=count <= mcfg.BLOCK_S,
            HAS_LENGTH=src.length is not None, HAS_PRIOR=carried is not None, BEST=best,
            PRIOR_BEST=best and p_best is not None,
            num_warps=mcfg.num_warps, num_stages=mcfg.num_stages,
        )
        carried = (out, lse, top)
    return carried


def _length_stride(length: torch.Tensor | None) -> int:
    """The element stride of a per-sequence ``length [B]`` as the kernels read it (``LENGTH + b * stride``): 0 for one
    count shared by every sequence (``.expand(B)`` of a ``[1]`` tensor, what a fixed-capacity layer passes)."""
    return 0 if length is None else length.stride(0)


def decode_attention_triton(
    query: torch.Tensor, sources: list[Rows], scaling: float, *, splits: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The split-K kernels and the merge kernel (see the module docstring); ``splits`` per source."""
    out, lse, _ = launch(query, _validate(query, sources, scaling, splits), float(scaling), splits)
    return out, lse


def attend_triton(query: torch.Tensor, checked: list[_Source], scaling: float, splits: int | None, *, best: bool,
                  prior: Attended | None = None, defer: bool = False) -> Attended:
    """A part of a step on the kernels: s* from the split kernel's per-split maxima (no second read of the rows); a
    deferred part keeps its output in fp32; ``prior`` is folded into this part's merge: one softmax over both."""
    if prior is not None:
        out, lse, _ = launch(query, checked, scaling, splits, prior=(prior.out, prior.lse))
        return Attended(out, lse, prior.best)
    out, lse, top = launch(query, checked, scaling, splits, best=best, out_dtype=torch.float32 if defer else None)
    return Attended(out, lse, top)
