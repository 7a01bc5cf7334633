"""decode_attention's split-K and merge kernels against the PyTorch reference, in Triton's CPU interpreter.

Toy sizes with every ``tl.dot`` dimension >= 16: GQA rows of 32 dims (3 heads per KV group, padded to a
block of 16 heads), MLA absorbed rows of 32 + 16 dims (value = the first 32). fp32 and fp16 only (the
interpreter computes bf16 wrong); tolerances from conftest.TOLERANCE, relative to the reference's largest
magnitude. The lse is checked wherever the output is.
"""

from __future__ import annotations

import pytest
import torch

from kvzoo.kernels import decode_attention as da
from kvzoo.kernels.decode_attention import (
    Rows,
    decode_attention,
    decode_attention_reference,
    decode_attention_triton,
)
from tests.interpreter import TOLERANCE

DTYPES = [torch.float32, torch.float16]
SCALE = 0.3
# form -> (KV groups, heads per group, key width, value width, separate values)
FORMS = {"gqa": (2, 3, 32, 32, True), "mla": (1, 5, 48, 32, False)}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _pool(form: str, seed: int, B: int, N: int, dtype: torch.dtype) -> tuple[torch.Tensor, Rows]:
    """A query [B, H, D] and a dense source of N rows (no flags)."""
    G, hpg, D, Dv, separate = FORMS[form]
    g = _gen(seed)
    query = torch.randn(B, G * hpg, D, generator=g).to(dtype)
    keys = torch.randn(B, G, N, D, generator=g).to(dtype)
    if separate:
        return query, Rows(keys, torch.randn(B, G, N, Dv, generator=g).to(dtype))
    return query, Rows(keys, value_width=Dv)


def _with(rows: Rows, **changes) -> Rows:
    return Rows(**{**rows.__dict__, **changes})


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    a, ref = a.float(), ref.float()
    return ((a - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def _close(got, want, dtype: torch.dtype) -> None:
    """The kernel's (out, lse) against the reference's: no NaN, the same empty heads, within tolerance."""
    (out, lse), (r_out, r_lse) = got, want
    tol = TOLERANCE[str(dtype).removeprefix("torch.")]
    assert out.dtype == r_out.dtype and out.shape == r_out.shape and lse.dtype == torch.float32
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert torch.equal(torch.isneginf(lse), torch.isneginf(r_lse))
    assert _rel(out, r_out) <= tol, f"out: relative error {_rel(out, r_out):.2e} > {tol}"
    finite = torch.isfinite(r_lse)
    if finite.any():
        err = _rel(lse[finite], r_lse[finite])
        assert err <= tol, f"lse: relative error {err:.2e} > {tol}"


def _tiles(form: str, query: torch.Tensor, positions: int) -> int:
    G, hpg, D, Dv, separate = FORMS[form]
    block_n = da.split_config(hpg, D, Dv, separate, query.element_size()).BLOCK_N
    return -(-positions // block_n)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("form", FORMS)
def test_dense_rows_with_valid_and_length_match_the_reference(form, dtype):
    B, N = 2, 150  # not a multiple of the tile (64 or 32 rows)
    query, rows = _pool(form, 1, B, N, dtype)
    G = rows.keys.shape[1]
    valid = torch.rand(B, G, N, generator=_gen(2)) < 0.8
    length = torch.tensor([N, 97], dtype=torch.int32)
    src = _with(rows, valid=valid, length=length)
    got = decode_attention(query, [src], SCALE)
    want = decode_attention_reference(query, [src], SCALE)
    _close(got, want, dtype)
    # the flags are honoured: without them the answer is another one
    assert _rel(got[0], decode_attention_reference(query, [rows], SCALE)[0]) > 1e-2


@pytest.mark.parametrize("splits", [1, 2, 3, 7])
@pytest.mark.parametrize("form", FORMS)
def test_any_split_count_gives_the_same_result(form, splits):
    B, N = 2, 150
    query, rows = _pool(form, 3, B, N, torch.float32)
    src = _with(rows, length=torch.tensor([N, 101]))
    assert 7 > _tiles(form, query, N)  # the largest count leaves some splits without a tile
    got = decode_attention_triton(query, [src], SCALE, splits=splits)
    _close(got, decode_attention_reference(query, [src], SCALE), torch.float32)
    if splits != 1:
        one = decode_attention_triton(query, [src], SCALE, splits=1)
        assert _rel(got[0], one[0]) <= 1e-5 and _rel(got[1], one[1]) <= 1e-5


@pytest.mark.parametrize("form", FORMS)
def test_more_splits_than_tiles_and_the_default_split_count(form):
    query, rows = _pool(form, 4, 1, 40, torch.float16)
    assert _tiles(form, query, 40) < 5
    want = decode_attention_reference(query, [rows], SCALE)
    _close(decode_attention_triton(query, [rows], SCALE, splits=5), want, torch.float16)
    _close(decode_attention_triton(query, [rows], SCALE), want, torch.float16)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("form", FORMS)
def test_empty_sequences_give_zero_and_minus_infinity(form, dtype):
    B, N = 3, 70
    query, rows = _pool(form, 5, B, N, dtype)
    G = rows.keys.shape[1]
    valid = torch.rand(B, G, N, generator=_gen(6)) < 0.7
    valid[1] = False  # sequence 1: every row invalid
    length = torch.tensor([0, N, 53])  # sequence 0: length 0
    src = _with(rows, valid=valid, length=length)
    out, lse = decode_attention_triton(query, [src], SCALE, splits=3)
    _close((out, lse), decode_attention_reference(query, [src], SCALE), dtype)
    assert torch.equal(out[:2], torch.zeros_like(out[:2])) and torch.isneginf(lse[:2]).all()
    assert torch.isfinite(lse[2]).all()


@pytest.mark.parametrize("form", FORMS)
def test_empty_pools_and_empty_index_lists(form):
    query, rows = _pool(form, 7, 2, 0, torch.float32)
    out, lse = decode_attention_triton(query, [rows], SCALE, splits=2)
    assert out.abs().max() == 0 and torch.isneginf(lse).all()
    _, pool = _pool(form, 8, 2, 30, torch.float32)
    no_index = _with(pool, indices=torch.zeros(2, pool.keys.shape[1], 0, dtype=torch.int64))
    out, lse = decode_attention_triton(query, [no_index], SCALE)
    assert out.abs().max() == 0 and torch.isneginf(lse).all()
    # an empty source beside a real one changes nothing
    want = decode_attention_reference(query, [pool], SCALE)
    _close(decode_attention_triton(query, [no_index, pool], SCALE), want, torch.float32)


def _gathered(rows: Rows, indices: torch.Tensor) -> Rows:
    """The dense source holding the rows ``indices`` names (duplicates copied)."""
    def pick(t):
        return torch.gather(t, 2, indices[..., None].expand(*indices.shape, t.shape[-1]))
    return Rows(pick(rows.keys), None if rows.values is None else pick(rows.values), rows.value_width)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("form", FORMS)
def test_gathered_rows_equal_the_dense_rows_they_name(form, dtype):
    B, N, K = 2, 90, 70
    query, pool = _pool(form, 9, B, N, dtype)
    G = pool.keys.shape[1]
    indices = torch.randint(0, N, (B, G, K), generator=_gen(10))
    indices[:, :, 5] = indices[:, :, 4]  # duplicates, read twice like a gather
    assert any(len(set(row.tolist())) < K for row in indices.view(-1, K))
    valid = torch.rand(B, G, K, generator=_gen(11)) < 0.85
    length = torch.tensor([K, 45], dtype=torch.int32)
    gathered = _with(pool, indices=indices, valid=valid, length=length)
    dense = _with(_gathered(pool, indices), valid=valid, length=length)
    got = decode_attention_triton(query, [gathered], SCALE, splits=2)
    _close(got, decode_attention_reference(query, [gathered], SCALE), dtype)
    _close(got, decode_attention_triton(query, [dense], SCALE, splits=2), dtype)
    # a duplicate counts twice: dropping one copy changes the answer
    once = valid.clone()
    once[:, :, 5] = False
    assert _rel(got[0], decode_attention_triton(query, [_with(gathered, valid=once)], SCALE)[0]) > 1e-4


def test_indices_outside_the_pool_are_unreadable():
    B, N, K = 2, 40, 30
    query, pool = _pool("gqa", 12, B, N, torch.float32)
    indices = torch.randint(0, N, (B, 2, K), generator=_gen(13))
    outside = torch.rand(B, 2, K, generator=_gen(14)) < 0.3
    padded = torch.where(outside, torch.where(torch.rand(B, 2, K, generator=_gen(15)) < 0.5, -1, N), indices)
    got = decode_attention_triton(query, [_with(pool, indices=padded)], SCALE)
    same = decode_attention_triton(query, [_with(pool, indices=indices, valid=~outside)], SCALE)
    _close(got, same, torch.float32)
    _close(got, decode_attention_reference(query, [_with(pool, indices=padded)], SCALE), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("form", FORMS)
def test_head_valid_per_query_head(form, dtype):
    B, N = 2, 100
    query, rows = _pool(form, 16, B, N, dtype)
    H, G = query.shape[1], rows.keys.shape[1]
    head_valid = torch.rand(B, H, N, generator=_gen(17)) < 0.5
    head_valid[1, 2] = False  # one head reads nothing
    src = _with(rows, head_valid=head_valid, length=torch.tensor([N, 77]))
    out, lse = decode_attention_triton(query, [src], SCALE, splits=2)
    _close((out, lse), decode_attention_reference(query, [src], SCALE), dtype)
    assert torch.isneginf(lse[1, 2]) and out[1, 2].abs().max() == 0
    # the same flags for every head of a group are the group's valid
    group = torch.rand(B, G, N, generator=_gen(18)) < 0.6
    per_head = group.repeat_interleave(H // G, dim=1)
    _close(decode_attention_triton(query, [_with(rows, head_valid=per_head)], SCALE),
           decode_attention_triton(query, [_with(rows, valid=group)], SCALE), dtype)


def test_more_than_32_heads_per_group_with_valid_and_head_valid():
    """40 heads over one latent group: a block of 64 heads, flags in two words per row."""
    B, N, H = 1, 60, 40
    g = _gen(19)
    query = torch.randn(B, H, 48, generator=g)
    rows = Rows(torch.randn(B, 1, N, 48, generator=g), value_width=32)
    valid = torch.rand(B, 1, N, generator=g) < 0.7
    head_valid = torch.rand(B, H, N, generator=g) < 0.5
    head_valid[0, 35] = False  # a head of the second word reads nothing
    for src in (_with(rows, valid=valid), _with(rows, valid=valid, head_valid=head_valid)):
        want = decode_attention_reference(query, [src], SCALE)
        _close(decode_attention_triton(query, [src], SCALE, splits=2), want, torch.float32)
    assert torch.isneginf(want[1][0, 35]) and torch.isfinite(want[1][0, 34])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("form", FORMS)
def test_two_sources_equal_their_rows_merged_into_one(form, dtype):
    B, N, M, K = 2, 80, 60, 50
    query, pool = _pool(form, 20, B, N, dtype)
    _, archive = _pool(form, 21, B, M, dtype)
    H, G = query.shape[1], pool.keys.shape[1]
    valid = torch.rand(B, G, N, generator=_gen(22)) < 0.8
    indices = torch.randint(0, M, (B, G, K), generator=_gen(23))
    head_valid = torch.rand(B, H, K, generator=_gen(24)) < 0.6
    fetched_valid = torch.rand(B, G, K, generator=_gen(25)) < 0.9
    first = _with(pool, valid=valid)
    second = _with(archive, indices=indices, valid=fetched_valid, head_valid=head_valid)
    fetched = _gathered(archive, indices)
    merged_values = None if pool.values is None else torch.cat([pool.values, fetched.values], 2)
    merged = Rows(torch.cat([pool.keys, fetched.keys], 2), merged_values, pool.value_width,
                  valid=torch.cat([valid, fetched_valid], 2),
                  head_valid=torch.cat([torch.ones(B, H, N, dtype=torch.bool), head_valid], 2))
    got = decode_attention_triton(query, [first, second], SCALE, splits=2)
    _close(got, decode_attention_reference(query, [first, second], SCALE), dtype)
    _close(got, decode_attention_triton(query, [merged], SCALE, splits=3), dtype)


@pytest.mark.parametrize("form", FORMS)
def test_a_preallocated_pool_with_garbage_outside_the_readable_rows(form):
    """The whole buffer is passed with a device length; rows past it and invalid rows hold NaN."""
    B, N, capacity = 2, 70, 128
    query, rows = _pool(form, 26, B, N, torch.float32)
    G = rows.keys.shape[1]
    valid = torch.rand(B, G, N, generator=_gen(27)) < 0.8
    clean = _with(rows, valid=valid)

    def buffer(t):
        full = torch.full((*t.shape[:2], capacity, t.shape[-1]), float("nan"))
        full[:, :, :N] = t
        full[:, :, :N][~valid] = float("nan")
        return full

    length = torch.tensor([N, N - 11])
    capacity_valid = torch.cat([valid, torch.zeros(B, G, capacity - N, dtype=torch.bool)], 2)
    dirty = Rows(buffer(rows.keys), None if rows.values is None else buffer(rows.values), rows.value_width,
                 valid=capacity_valid, length=length)
    got = decode_attention_triton(query, [dirty], SCALE, splits=3)
    _close(got, decode_attention_reference(query, [_with(clean, length=length)], SCALE), torch.float32)
    _close(got, decode_attention_reference(query, [dirty], SCALE), torch.float32)


def test_strided_views_and_a_full_precision_query_over_half_rows():
    """Rows as views of a wider buffer (row stride 40: not 16-aligned); a float32 query over float16 rows."""
    B, G, N = 2, 2, 90
    g = _gen(28)
    wide = torch.randn(B, G, N, 40, generator=g).half()
    values = torch.randn(B, G, N, 48, generator=g).half()[..., 8:40]
    query = torch.randn(B, 6, 32, generator=g)
    src = Rows(wide[..., :32], values, valid=torch.rand(B, G, N, generator=g) < 0.9)
    assert not da.triton._aligned(src.keys, src.values)
    out, lse = decode_attention_triton(query, [src], SCALE)
    assert out.dtype == torch.float32
    _close((out, lse), decode_attention_reference(query, [src], SCALE), torch.float16)


def test_decode_attention_takes_the_kernel_or_the_reference_as_dispatch_says(monkeypatch):
    query, rows = _pool("gqa", 29, 1, 20, torch.float32)
    calls = []
    real = da.triton.launch
    monkeypatch.setattr(da.triton, "launch", lambda *a, **k: calls.append(1) or real(*a, **k))
    want = decode_attention_reference(query, [rows], SCALE)
    _close(decode_attention(query, [rows], SCALE), want, torch.float32)
    assert calls == [1]
    monkeypatch.setenv("KVZOO_KERNELS", "torch")
    decode_attention(query, [rows], SCALE)
    assert calls == [1]


def test_bfloat16_in_the_interpreter_is_refused_by_name():
    query, rows = _pool("gqa", 30, 1, 20, torch.bfloat16)
    with pytest.raises(ValueError, match="bfloat16 is computed wrong"):
        decode_attention(query, [rows], SCALE)


def test_a_bad_input_is_a_value_error_not_a_kernel_fallback():
    query, rows = _pool("gqa", 31, 1, 20, torch.float32)
    with pytest.raises(ValueError, match=r"sources\[0\].valid must have shape \[1, 2, 20\]"):
        decode_attention(query, [_with(rows, valid=torch.ones(1, 2, 19, dtype=torch.bool))], SCALE)


@pytest.mark.parametrize("hpg", [65, 80, 96])
def test_groups_of_65_to_96_heads_read_their_own_flag_words_and_never_nan_rows(hpg):
    """Two KV groups of 65-96 heads: a block of 128 heads, flags packed in ceil(hpg / 32) = 3 words per position.
    The kernel reads exactly those words (it once looped over BLOCK_H / 32 = 4: the fourth was the next group's,
    or past the end of the tensor). Group 0's heads may read rows [0, 16) only, and rows [16, 32) hold NaN."""
    B, G, N, D, Dv = 1, 2, 32, 32, 16
    g = _gen(40 + hpg)
    query = torch.randn(B, G * hpg, D, generator=g)
    keys = torch.randn(B, G, N, D, generator=g)
    keys[0, 0, 16:] = float("nan")
    head_valid = torch.rand(B, G * hpg, N, generator=g) < 0.7
    head_valid[0, :hpg, 16:] = False  # group 0: no head reads the NaN rows
    head_valid[0, hpg:, 16:] = True  # group 1 reads them (its own rows, finite)
    head_valid[0, 70 % hpg] = False  # a head of the third word reads nothing
    src = Rows(keys, value_width=Dv, head_valid=head_valid)
    want = decode_attention_reference(query, [src], SCALE)
    assert torch.isfinite(want[0]).all()
    _close(decode_attention_triton(query, [src], SCALE, splits=2), want, torch.float32)
    valid = torch.ones(B, G, N, dtype=torch.bool)
    valid[0, 0, 16:] = False  # the same rows unreadable by valid alone (every word of the group: 0)
    _close(decode_attention_triton(query, [Rows(keys, value_width=Dv, valid=valid)], SCALE),
           decode_attention_reference(query, [Rows(keys, value_width=Dv, valid=valid)], SCALE), torch.float32)


@pytest.mark.parametrize("form", FORMS)
def test_the_best_score_comes_from_the_split_kernel(form, monkeypatch):
    """s*: each split's maximum, reduced by the merge; no second read of the rows in PyTorch. A deferred part keeps
    its output in fp32 for the merge that ends the step."""
    query, rows = _pool(form, 41, 2, 150, torch.float16)
    valid = torch.rand(2, rows.keys.shape[1], 150, generator=_gen(42)) < 0.8
    valid[1] = False  # a sequence with nothing readable: best -inf
    src = _with(rows, valid=valid)
    monkeypatch.setattr(da.sdpa, "attend_sdpa", lambda *a, **k: pytest.fail("the kernel path read the rows again"))
    part = da.attend(query, [src], SCALE, best=True, defer=True, impl="triton", splits=3)
    ref = da.attend(query, [src], SCALE, lse=True, best=True, impl="reference")
    assert part.out.dtype == torch.float32 and part.best.dtype == torch.float32
    assert torch.isneginf(part.best[1]).all() and torch.isfinite(part.best[0]).all()
    assert _rel(part.best[0], ref.best[0]) <= 1e-5
    _close((part.out.half(), part.lse), (ref.out.half(), ref.lse), torch.float16)


def test_a_prior_part_is_merged_by_the_merge_kernel(monkeypatch):
    """The runtime's retrieving step: the tier deferred (with its best score), then the fetched rows with that part
    as the prior, folded into the merge kernel (no PyTorch merge); the best score stays the tier's."""
    query, sources = __import__("tests.test_decode_attention_reference", fromlist=["CASES"]).CASES["gqa-head-valid"]
    monkeypatch.setattr(da.sdpa, "attend_sdpa", lambda *a, **k: pytest.fail("a PyTorch merge on the kernel path"))
    first = da.attend(query, sources[:1], SCALE, best=True, defer=True, impl="triton")
    both = da.attend(query, sources[1:], SCALE, lse=True, prior=first, impl="triton")
    ref = da.attend(query, sources, SCALE, lse=True, impl="reference")
    _close((both.out, both.lse), (ref.out.to(query.dtype), ref.lse), torch.float32)
    assert both.best is first.best


def test_a_split_with_no_positions_writes_nothing(monkeypatch):
    """Partials start as NaN: the empty splits' slots stay NaN (never written) and the merge reads none of them."""
    query, rows = _pool("gqa", 43, 2, 150, torch.float32)
    src = _with(rows, length=torch.tensor([150, 40]))  # sequence 1: 1 tile of 64 rows, 6 of its 7 splits empty
    made = []

    def poisoned(*args):
        buffers = real(*args)
        for t in buffers:
            t.fill_(float("nan"))
        made.append(buffers)
        return buffers

    real = da.triton._partials
    monkeypatch.setattr(da.triton, "_partials", poisoned)
    got = decode_attention_triton(query, [src], SCALE, splits=7)
    _close(got, decode_attention_reference(query, [src], SCALE), torch.float32)
    part_o, part_l, _ = made[0]
    assert torch.isnan(part_l[1, :, 1:]).all() and torch.isnan(part_o[1, :, 1:]).all()  # never written
    assert not torch.isnan(part_l[1, :, 0]).any() and not torch.isnan(part_l[0, :, :3]).any()
    assert torch.isnan(part_l[0, :, 3:]).all()  # 150 rows = 3 tiles: splits 3..6 hold none


def test_more_splits_than_one_merge_tile_take_the_chunked_merge(monkeypatch):
    """Past MAX_MERGE_BLOCK_S splits the merge takes them in chunks (a maximum first, then one pass)."""
    monkeypatch.setattr(da.triton, "MAX_MERGE_BLOCK_S", 16)
    query, rows = _pool("mla", 44, 1, 40 * 64, torch.float32)
    assert da.merge_config(40).BLOCK_S == 16
    got = da.attend(query, [rows], SCALE, lse=True, best=True, impl="triton", splits=40)
    ref = da.attend(query, [rows], SCALE, lse=True, best=True, impl="reference")
    _close((got.out, got.lse), (ref.out.to(query.dtype), ref.lse), torch.float32)
    assert _rel(got.best, ref.best) <= 1e-5


# --- the op's case list (tests/test_decode_attention_reference.py), held against the reference ----------------------


@pytest.mark.parametrize("name", sorted(__import__("tests.test_decode_attention_reference",
                                                   fromlist=["CASES"]).CASES))
def test_the_triton_implementation_equals_the_reference_on_the_case_list(name, monkeypatch):
    from kvzoo.kernels.decode_attention import attend
    from tests.test_decode_attention_reference import CASES

    monkeypatch.setenv("KVZOO_KERNELS", "triton")  # a kernel error fails the test (no fallback)
    query, sources = CASES[name]
    ref = attend(query, sources, SCALE, lse=True, best=True, impl="reference")
    got = attend(query, sources, SCALE, lse=True, best=True, impl="triton")
    _close((got.out.to(query.dtype), got.lse), (ref.out.to(query.dtype), ref.lse), torch.float32)
    finite = torch.isfinite(ref.best)
    assert torch.equal(finite, torch.isfinite(got.best)) and _rel(got.best[finite], ref.best[finite]) <= 1e-5
    if len(sources) == 2:  # a step in two parts (the tier first, for its best score), merged by log-sum-exp
        first = attend(query, sources[:1], SCALE, best=True, defer=True, impl="triton")
        both = attend(query, sources[1:], SCALE, lse=True, prior=first, impl="triton")
        _close((both.out.to(query.dtype), both.lse), (ref.out.to(query.dtype), ref.lse), torch.float32)
