"""The fused decode-step ops of kvzoo/kernels/choose.py -- VestigeKV's sketch choice, Quest's page choice and its one-row
page add -- held to their PyTorch references, and the retrievers taking them on a CPU decode step."""

from __future__ import annotations

import pytest
import torch

from kvzoo import TieredCache, registry
from kvzoo.bench.step_trace import StepTrace, count_decode_step
from kvzoo.framework.attention import detach
from kvzoo.kernels import cpu_native
from kvzoo.kernels.choose import (
    quest_choose,
    quest_choose_reference,
    quest_page_add,
    quest_page_add_reference,
    sketch_choose,
    sketch_choose_reference,
)
from kvzoo.kernels.index_scan import (
    SKETCH_SLACK,
    SKETCH_SLACK_FP16,
    fused_choose_applies,
    int8_choose,
    int8_choose_reference,
    int8_key_entries,
    round_entries_fp16,
    sketch_entries,
)
from kvzoo.models import TINY_FAMILIES, tiny_llama
from kvzoo.retrievers.quest import PageSummary, _quest_entries

needs_compiler = pytest.mark.skipif(cpu_native.toolchain_missing() is not None,
                                    reason=f"{cpu_native.toolchain_missing()}: the CPU kernels are not built here "
                                           "(kvzoo takes the PyTorch references)")



# --- VestigeKV's sketch ------------------------------------------------------------------------------------------------


def _sketch(B, G, hq, dc, dr, rank, rows, spare, dtype, seed):
    """A sketch index over random rows (a buffer with ``spare`` rows more), its basis, a query and a floor."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(B, G, rows + spare, dc + dr, generator=g)
    basis = torch.linalg.qr(torch.randn(B, G, dc, dc, generator=g)).Q[..., :rank].contiguous()
    entries = sketch_entries(keys[..., :dc], keys[..., dc:] if dr else None, basis)
    slack = SKETCH_SLACK
    if dtype == torch.float16:
        entries, slack = round_entries_fp16(entries, rank, dr), SKETCH_SLACK_FP16
    query = torch.randn(B, G, hq, dc + dr, generator=g)
    floor = torch.randn(B, G, hq, generator=g) * 2 + 3  # some rows' bounds above it, some below
    return query, basis, entries, floor, slack


@needs_compiler
@pytest.mark.parametrize("rank_by", ["estimate", "bound"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("B", "G", "hq", "dc", "dr", "rank", "rows", "spare", "j"), [
    (2, 3, 3, 64, 0, 16, 300, 20, 16),  # GQA (SmolLM2's geometry): the whole key is the content
    (1, 1, 16, 64, 16, 8, 500, 0, 16),  # MLA: a content part and a branch
    (2, 1, 4, 32, 8, 32, 40, 5, 8),  # full rank, a few rows
    (1, 2, 1, 16, 0, 4, 3, 2, 3),  # j = every live row
])
def test_sketch_choose_matches_reference(B, G, hq, dc, dr, rank, rows, spare, j, dtype, rank_by):
    """The C op chooses what the reference (today's torch path) chooses, staged alike, and counts it into the
    counter; a fixed buffer is read whole with the live count (the second sequence has half the rows)."""
    query, basis, entries, floor, slack = _sketch(B, G, hq, dc, dr, rank, rows, spare, dtype, seed=rows)
    length = torch.tensor([rows] + [max(1, rows // 2)] * (B - 1))
    archived = rows + spare + 2  # the archive list may be longer than the index scanned
    assert cpu_native.sketch_choose_supported(query, basis, entries, floor, j)
    counter, ref_counter = torch.tensor(7), torch.tensor(7)
    idx, picked, count = sketch_choose(query, basis, entries, floor, j, archived, 0.3, slack=slack, rank_by=rank_by,
                                       length=length, counter=counter)
    want = sketch_choose_reference(query, basis, entries, floor, j, archived, 0.3, slack=slack, rank_by=rank_by,
                                   length=length, counter=ref_counter)
    assert idx.shape == picked.shape == (B, G, hq * j)
    assert torch.equal(idx, want[0]) and torch.equal(picked, want[1])
    assert int(count) == int(want[2]) == int(picked.sum()) and int(counter) == int(ref_counter) == 7 + int(count)
    assert picked.any() and (~picked).any()  # the floor keeps some rows and leaves others
    live = length.view(B, 1, 1).expand_as(idx)
    assert (idx[picked] < live[picked]).all()  # never a row past a sequence's live rows


@needs_compiler
@pytest.mark.parametrize("threads", [1, 2])
def test_sketch_choose_over_threads_matches_reference(threads, threads_at_any_size):
    """Runs of rows scanned on several threads (forced at this size), each run's top lists merged in row order."""
    query, basis, entries, floor, slack = _sketch(1, 1, 8, 64, 16, 16, 3000, 0, torch.float32, seed=3)
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        got = sketch_choose(query, basis, entries, floor, 16, 3000, 0.2, slack=slack)
    finally:
        torch.set_num_threads(saved)
    want = sketch_choose_reference(query, basis, entries, floor, 16, 3000, 0.2, slack=slack)
    assert all(torch.equal(a, b) for a, b in zip(got, want)) and got[1].any()


def _padding_flags(B, G, m, seed):
    """Row flags ``[B, G, m]``: a run of leading padding rows per sequence (left padding), and a few scattered."""
    g = torch.Generator().manual_seed(seed)
    valid = torch.rand(B, G, m, generator=g) > 0.1
    for b in range(B):
        valid[b, :, : (b + 1) * m // 5] = False
    return valid


@needs_compiler
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rank_by", ["estimate", "bound"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_sketch_choose_never_picks_a_padding_row(dtype, rank_by, threads, threads_at_any_size):
    """Issue 44 item 2: with row flags a padding row takes no top-j slot; the C op (runs of valid rows, on one thread
    or several) chooses what the reference chooses, which is the choice over the valid rows alone."""
    B, G, hq, dc, rows, spare, j = 2, 2, 4, 64, 300, 20, 16
    query, basis, entries, floor, slack = _sketch(B, G, hq, dc, 0, 16, rows, spare, dtype, seed=5)
    floor = floor - 10  # every top row is kept: the slots are what padding would take
    valid = _padding_flags(B, G, rows + spare, seed=6)
    length = torch.tensor([rows, rows // 2])
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        got = sketch_choose(query, basis, entries, floor, j, rows + spare, 0.3, slack=slack, rank_by=rank_by,
                            length=length, valid=valid)
    finally:
        torch.set_num_threads(saved)
    want = sketch_choose_reference(query, basis, entries, floor, j, rows + spare, 0.3, slack=slack, rank_by=rank_by,
                                   length=length, valid=valid)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    idx, picked, count = got
    assert int(picked.sum()) == int(count) > 0
    assert valid.gather(2, idx)[picked].all()  # no padding row picked
    unflagged = sketch_choose_reference(query, basis, entries, floor, j, rows + spare, 0.3, slack=slack,
                                        rank_by=rank_by, length=length)
    assert not valid.gather(2, unflagged[0])[unflagged[1]].all()  # without the flags, padding takes slots
    with pytest.raises(ValueError, match="valid"):
        sketch_choose(query, basis, entries, floor, j, rows + spare, 0.3, slack=slack, valid=valid[:, :, :10])


@needs_compiler
@pytest.mark.parametrize("prune", [False, True])
def test_int8_choose_never_picks_a_padding_row(prune):
    """Issue 44 item 2: ``valid`` leaves padding rows out of the int8 top-j rule as a dead page's rows (pages of one
    row, joined to pruning's page flags); the C op and the reference agree."""
    g = torch.Generator().manual_seed(8)
    B, G, hq, D, m, j = 2, 2, 3, 64, 200, 16
    codes, side = int8_key_entries(torch.randn(B, G, m, D, generator=g))
    query = torch.randn(B, G, hq, D, generator=g)
    threshold = torch.full((B, G, hq), -1e9)
    valid = _padding_flags(B, G, m, seed=9)
    page_live = torch.rand(B, G, -(-m // 8), generator=g) > 0.3 if prune else None
    args = (query, codes, side, threshold, j, m, 0.125)
    pruning = {"page_live": page_live, "page_rows": 8 if prune else 0}
    got = int8_choose(*args, valid=valid, **pruning)
    flags = valid if page_live is None else valid & page_live.repeat_interleave(8, dim=2)[:, :, :m]
    assert fused_choose_applies(query, codes, side, j, page_live=flags)  # the C op ran
    want = int8_choose_reference(*args, page_live=flags, page_rows=1)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    idx, picked, _ = got
    assert picked.any() and flags.gather(2, idx)[picked].all()


def test_sketch_choose_takes_the_reference_in_torch_mode(monkeypatch):
    query, basis, entries, floor, slack = _sketch(1, 2, 3, 16, 0, 4, 50, 0, torch.float32, seed=4)
    monkeypatch.setenv("KVZOO_KERNELS", "torch")
    got = sketch_choose(query, basis, entries, floor, 8, 50, 0.5, slack=slack)
    want = sketch_choose_reference(query, basis, entries, floor, 8, 50, 0.5, slack=slack)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    with pytest.raises(ValueError, match="rank_by"):
        sketch_choose(query, basis, entries, floor, 8, 50, 0.5, rank_by="exact")


# --- Quest's pages -----------------------------------------------------------------------------------------------------


def _pages(B, G, hq, D, P, live, size, padding_page, dtype, seed):
    """Quest's page entries over ``live`` random rows in ``P`` page slots (the unused ones empty), a page of padding
    rows (empty too) if asked, a query and an archive list (a permutation: each row's storage position)."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(B, G, P * size, D, generator=g).to(dtype).float()
    valid = (torch.arange(P * size) < live).expand(B, G, -1).clone()
    if padding_page is not None:
        valid[:, :, padding_page * size:(padding_page + 1) * size] = False
    lo = keys.masked_fill(~valid[..., None], float("inf")).view(B, G, P, size, D).amin(3)
    hi = keys.masked_fill(~valid[..., None], float("-inf")).view(B, G, P, size, D).amax(3)
    encoded = _quest_entries(lo, hi, dtype)["entries"]
    empty = torch.isinf(lo).all(-1) & torch.isinf(hi).all(-1)
    query = torch.randn(B, G, hq, D, generator=g)
    M = P * size + 7
    positions = torch.stack([torch.randperm(M, generator=g) for _ in range(B * G)]).view(B, G, M)
    return query, encoded, empty, torch.tensor([live]), positions


@needs_compiler
@pytest.mark.parametrize("per_head", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("B", "G", "hq", "D", "P", "live", "size", "pages", "padding_page"), [
    (2, 3, 3, 16, 20, 150, 16, 4, 2),  # GQA; a page of padding rows among the live ones, unused page slots
    (1, 1, 16, 72, 12, 90, 8, 9, None),  # MLA-like: one group of 16 heads; a partial last page
    (2, 2, 2, 8, 6, 18, 4, 6, None),  # more pages asked than live: the unused slots' rows are not valid
])
def test_quest_choose_matches_reference(B, G, hq, D, P, live, size, pages, padding_page, dtype, per_head):
    query, entries, empty, live_t, positions = _pages(B, G, hq, D, P, live, size, padding_page, dtype, seed=P)
    assert cpu_native.quest_choose_supported(query, entries, empty, live_t, positions)
    archived = positions.shape[2]
    for given in (positions, None):
        counter, ref_counter = torch.tensor(3), torch.tensor(3)
        got = quest_choose(query, entries, empty, live_t, given, pages, size, archived, 0.7, per_head=per_head,
                           counter=counter)
        want = quest_choose_reference(query, entries, empty, live_t, given, pages, size, archived, 0.7,
                                      per_head=per_head, counter=ref_counter)
        K = (hq if per_head else 1) * pages * size
        assert got[0].shape == got[2].shape == (B, G, K)
        assert torch.equal(got[0], want[0]) and torch.equal(got[2], want[2])
        assert (got[1] is None) == (given is None) and (given is None or torch.equal(got[1], want[1]))
        assert int(got[3]) == int(want[3]) and int(counter) == int(ref_counter) == 3 + int(got[3])
    if per_head:  # each head's segment holds its own best page: sum_i max(q_i min_i, q_i max_i) (+ slack)
        e = entries.float()
        q = query[..., None, :]
        bound = torch.maximum(q * e[:, :, None, :, D:2 * D], q * e[:, :, None, :, :D]).sum(-1)  # [B, G, hq, P]
        bound += SKETCH_SLACK * query.abs().sum(-1, keepdim=True) * e[:, :, None, :, 2 * D]
        best = bound.masked_fill(empty[:, :, None], float("-inf")).argmax(-1)  # [B, G, hq]
        segments = (got[0].view(B, G, hq, pages, size)[..., 0] // size).clamp(max=P - 1)  # its pages (clamped rows)
        in_reach = best * size < live
        assert ((segments == best[..., None]).any(-1) | ~in_reach).all() and in_reach.any()
        assert (segments.diff(dim=-1) >= 0).all()  # in ascending page order


def _own_row(B, G, D, P, live, size, dtype, padding, seed):
    """The step's own row for :func:`quest_choose` (``own``): a storage of random keys with the row (8 times as large)
    at a random position (padding if asked), and the open page's running min/max over random rows (stale ones, a completed page's,
    when the row opens a page: the op must not read them then)."""
    g = torch.Generator().manual_seed(seed)
    N = 40
    keys = torch.randn(B, G, N, D, generator=g).to(dtype)
    valid = torch.ones(B, G, N, dtype=torch.bool)
    position = torch.randint(0, N, (B, G), generator=g)
    at = position[..., None, None].expand(B, G, 1, D)
    keys.scatter_(2, at, keys.gather(2, at) * 8)  # a large own key: a query along it ranks its page first
    if padding:
        valid.scatter_(2, position[..., None], False)
    earlier = torch.randn(B, G, 5, D, generator=g).to(dtype).float()
    return keys, valid, position, earlier.amin(2).contiguous(), earlier.amax(2).contiguous()


@needs_compiler
@pytest.mark.parametrize("per_head", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("P", "live", "padding"), [
    (20, 150, False),  # the current page partial: its min/max joined with the own key
    (20, 144, False),  # the own key opens a page inside the summary's slots
    (9, 144, False),  # ... past them (a growing summary): the extra slot
    (20, 150, True),  # a padding own row joins nothing
    (9, 144, True),  # a padding own row opening a page: the page stays empty
])
def test_quest_choose_with_the_own_row_matches_reference(P, live, padding, dtype, per_head):
    B, G, hq, D, size = 2, 2, 3, 16, 16
    query, entries, empty, live_t, positions = _pages(B, G, hq, D, P, live, size, None, dtype, seed=live + P)
    own = _own_row(B, G, D, P, live, size, dtype, padding, seed=P)
    assert cpu_native.quest_choose_supported(query, entries, empty, live_t, positions, None, own)
    archived = positions.shape[2]
    for pages in (1, 4, P + 1):
        got = quest_choose(query, entries, empty, live_t, positions, pages, size, archived, 0.7, per_head=per_head,
                           own=own)
        want = quest_choose_reference(query, entries, empty, live_t, positions, pages, size, archived, 0.7,
                                      per_head=per_head, own=own)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])
        assert int(got[3]) == int(want[3])
    # pages=1, per head: the current page wins for a query along the own key (it is read: its rows before the own)
    keys, valid, position = own[:3]
    key = keys.gather(2, position[..., None, None].expand(B, G, 1, D))[:, :, 0].float()  # [B, G, D]
    along = key[:, :, None].expand(B, G, hq, D) * 50
    rows = quest_choose(along, entries, empty, live_t, None, 1, size, archived, 0.7, own=own)[0]
    if not padding:
        assert (rows // size == live // size).all() if live % size else (rows == live - 1).all()  # opened: no rows


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quest_page_add_is_todays_path_and_the_op_matches_it(dtype):
    """One row a step joins Quest's fixed summary: the reference, read from the storage at a position, is bit for
    bit what ``PageSummary.add`` did with the gathered row (today's path), and the C op is bit for bit the reference
    (a page's entries are its keys' own values: no rounding anywhere)."""
    g = torch.Generator().manual_seed(2)
    B, G, N, D, size = 2, 3, 60, 16, 4
    keys = torch.randn(B, G, N, D, generator=g).to(dtype)
    valid = torch.rand(B, G, N, generator=g) > 0.3
    order = torch.stack([torch.randperm(N, generator=g) for _ in range(B * G)]).view(B, G, N)  # archive order
    valid.scatter_(2, order[:, :, 8:12], False)  # archived rows 8-11 are padding: their page is empty
    fields = {"entries": ((2 * D + 1,), dtype)}
    states = {}
    for impl in ("today", "reference", "native"):
        summary = PageSummary(size, _quest_entries, capacity=50)
        first = order[:, :, :5]  # a multi-row add defines the summary
        summary.add(keys.gather(2, first[..., None].expand(B, G, 5, D)), valid.gather(2, first), fields)
        for t in range(5, 40):
            at = order[:, :, t]
            if impl == "today":
                summary.add(keys.gather(2, at[..., None, None].expand(B, G, 1, D)), valid.gather(2, at[..., None]),
                            fields)
                continue
            add = quest_page_add_reference if impl == "reference" else quest_page_add
            pages = summary.pages
            add(keys, valid, at, summary.open_min, summary.open_max, pages.buffers["entries"], pages.buffers["empty"],
                summary.count, pages.length, size)
            summary.rows += 1
        last = order[:, :, 40:43]  # a multi-row add after single rows
        summary.add(keys.gather(2, last[..., None].expand(B, G, 3, D)), valid.gather(2, last), fields)
        states[impl] = (summary.open_min, summary.open_max, summary.pages.buffers["entries"],
                        summary.pages.buffers["empty"], summary.count, summary.pages.length)
        assert summary.rows == 43 and int(summary.count) == 43
    for name in ("reference", "native"):
        assert all(torch.equal(a, b) for a, b in zip(states[name], states["today"])), name
    assert states["native"][3][0, 0, 2]  # the padding page is flagged empty


@needs_compiler
def test_quest_page_add_refuses_a_full_summary():
    keys, valid = torch.randn(1, 1, 4, 8), torch.ones(1, 1, 4, dtype=torch.bool)
    args = (torch.full((1, 1, 8), float("inf")), torch.full((1, 1, 8), float("-inf")), torch.zeros(1, 1, 2, 17),
            torch.ones(1, 1, 2, dtype=torch.bool), torch.tensor([4]), torch.tensor([2]))
    with pytest.raises(ValueError, match=r"count \(the rows summarised\) must be in \[0, P x size = 4\), got 4: the "
                       "summary is full"):
        quest_page_add(keys, valid, torch.zeros(1, 1, dtype=torch.long), *args, 2)


# --- the ops as torch ops --------------------------------------------------------------------------------------------


@needs_compiler
def test_the_ops_check_their_inputs_in_cpp():
    """Each op checks its inputs once, in C++ (``csrc/ops.cpp``): a wrong shape, dtype or size is a ValueError that
    names what was wrong and what is valid, never a read out of bounds."""
    from kvzoo.kernels.index_scan import int8_key_entries

    ops = cpu_native.library()
    query, basis, entries, floor, slack = _sketch(1, 2, 3, 16, 0, 4, 40, 0, torch.float32, seed=5)
    args = (query, basis, entries, None, floor, 4, 40, 0.3, slack, False, None)
    bad = [
        ({5: 41}, r"kvzoo::sketch_choose: 1 <= j <= min\(64, m=40\) and archived >= 1, got j=41"),
        ({4: floor[..., :2]}, r"floor must have shape \[1, 2, 3\], got \[1, 2, 2\]"),
        ({2: entries.double()}, "entries must be float32 or float16, got Double"),
        ({10: torch.zeros(1, dtype=torch.int32)}, "counter must be a contiguous int64 tensor of one element"),
        ({3: torch.tensor([1, 2])}, r"length must have shape \[1\]"),
    ]
    for change, message in bad:
        with pytest.raises(ValueError, match=message):
            ops.sketch_choose(*(change.get(i, a) for i, a in enumerate(args)))
    codes, side = int8_key_entries(torch.randn(1, 2, 40, 16))
    q = torch.randn(1, 2, 3, 16)
    with pytest.raises(ValueError, match=r"kvzoo::int8_estimate: codes must have shape \[1, 2, 40, 16\]"):
        ops.int8_estimate(q, codes[:1, :1], side, None, 0.1)
    with pytest.raises(ValueError, match=r"a multiple of 8, got hq=3, D=12"):
        ops.int8_estimate(q[..., :12], codes[..., :12], side, None, 0.1)


@needs_compiler
def test_the_ops_are_registered_with_meta_impls_and_declared_mutations():
    """``torch.library.opcheck``: schema (the counter and the summary's buffers declared mutated), FakeTensor (the
    Meta impls), AOT dispatch (what torch.compile does with them)."""
    ops = cpu_native.library()  # built and loaded: torch.ops.kvzoo's overloads
    query, basis, entries, floor, slack = _sketch(1, 2, 3, 16, 0, 4, 40, 0, torch.float32, seed=5)
    counter = torch.tensor(0)
    checks = [(ops.sketch_choose,
               (query, basis, entries, None, floor, 4, 40, 0.3, slack, False, counter))]
    q, page_rows, empty, live, positions = _pages(1, 2, 3, 16, 10, 37, 4, None, torch.float32, seed=6)
    for per_head, at in ((True, positions), (False, None)):
        checks.append((ops.quest_choose,
                       (q, page_rows, empty, live, at, 3, 4, positions.shape[2], per_head, 0.3, SKETCH_SLACK, counter)))
    own = _own_row(1, 2, 16, 10, 37, 4, torch.float32, False, seed=7)  # the step's own row (rule="eval")
    checks.append((ops.quest_choose,
                   (q, page_rows, empty, live, positions, 11, 4, positions.shape[2], True, 0.3, SKETCH_SLACK, counter,
                    *own)))
    keys = torch.randn(1, 2, 40, 16)
    checks.append((ops.quest_page_add,
                   (keys, torch.ones(1, 2, 40, dtype=torch.bool), torch.zeros(1, 2, dtype=torch.long),
                    torch.full((1, 2, 16), float("inf")), torch.full((1, 2, 16), float("-inf")),
                    torch.zeros(1, 2, 10, 33), torch.ones(1, 2, 10, dtype=torch.bool), torch.zeros(1, dtype=torch.long),
                    torch.zeros(1, dtype=torch.long), 4)))
    for op, args in checks:
        result = torch.library.opcheck(op, args)
        assert set(result.values()) == {"SUCCESS"}, (op, result)


@needs_compiler
@pytest.mark.parametrize("march", ["x86-64", "haswell"])
def test_builds_without_avx512_match_the_references(march, monkeypatch):
    """The same source built without AVX-512 (plain x86-64's portable C; AVX2 with FMA), without OpenMP."""
    import os
    import subprocess

    flags = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    if march == "haswell" and not all(f" {f}" in flags for f in ("avx2", "fma", "f16c", "bmi2")):
        pytest.skip("this CPU cannot run AVX2 code")
    try:
        lib = cpu_native.compile_library(march, None)
    except subprocess.CalledProcessError as err:
        pytest.skip(f"the compiler does not build -march={march}: {err.stderr[:200]}")
    monkeypatch.setattr(cpu_native, "_LOADED", [lib])
    query, basis, entries, floor, slack = _sketch(2, 1, 5, 32, 8, 8, 70, 3, torch.float16, seed=7)
    got = sketch_choose(query, basis, entries, floor, 8, 75, 0.3, slack=slack)
    want = sketch_choose_reference(query, basis, entries, floor, 8, 75, 0.3, slack=slack)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    q, page_rows, empty, live, positions = _pages(2, 2, 3, 16, 12, 40, 4, 1, torch.bfloat16, seed=8)
    for per_head in (True, False):
        got = quest_choose(q, page_rows, empty, live, positions, 3, 4, positions.shape[2], 0.7, per_head=per_head)
        want = quest_choose_reference(q, page_rows, empty, live, positions, 3, 4, positions.shape[2], 0.7,
                                      per_head=per_head)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    # the int8 scan (AVX2 and portable loops), whole and pruned by page flags (issue 47)
    g = torch.Generator().manual_seed(9)
    codes, side = int8_key_entries(torch.randn(2, 3, 90, 64, generator=g))
    q, threshold = torch.randn(2, 3, 3, 64, generator=g), torch.randn(2, 3, 3, generator=g)
    for page_live in (None, torch.rand(2, 3, 6, generator=g) < 0.5):
        pages = {"page_live": page_live, "page_rows": 16 if page_live is not None else 0}
        scanned, ref_scanned = torch.tensor(0), torch.tensor(0)
        got = int8_choose(q, codes, side, threshold, 8, 90, 0.125, scanned=scanned, **pages)
        want = int8_choose_reference(q, codes, side, threshold, 8, 90, 0.125, scanned=ref_scanned, **pages)
        assert all(torch.equal(a, b) for a, b in zip(got, want)) and int(scanned) == int(ref_scanned) > 0
    # the page flags (the int8 loop on [hi, lo] codes): the reference's, where no bound is within rounding of its floor
    from kvzoo.kernels.index_scan import (
        int8_page_bounds,
        int8_page_entries,
        int8_page_live,
        int8_page_live_reference,
    )

    keys = torch.randn(2, 3, 40, 16, 64, generator=g)
    page_codes, page_scale = int8_page_entries(keys.amin(3), keys.amax(3))
    empty = torch.zeros(2, 3, 40, dtype=torch.bool)
    bounds = int8_page_bounds(q, page_codes, page_scale, 0.125)
    floor = bounds.quantile(0.7, dim=-1)
    near = ((bounds - floor[..., None]).abs() <= 1e-4 * (1 + bounds.abs())).any(2)
    got = int8_page_live(q, page_codes, page_scale, empty, floor, 0.125)
    want = int8_page_live_reference(q, page_codes, page_scale, empty, floor, 0.125)
    assert torch.equal(got[~near], want[~near])


# --- the retrievers on a CPU decode step -------------------------------------------------------------------------------

MODELS = TINY_FAMILIES
ARMS = {  # (policy, its parameters, the retriever's settings or None, the op a decode step's choice takes)
    "vestige": ("vestige", {"budget": 16}, None, None),  # GQA: int8 keys (int8_choose); MLA: the sketch
    "vestige-sketch": ("vestige", {"budget": 16}, {"index": "sketch"}, "sketch_choose"),
    "vestige-sketch-bound-fp16": ("vestige", {"budget": 16},
                                  {"index": "sketch", "rank_by": "bound", "entry_dtype": "float16"}, "sketch_choose"),
    "quest": ("quest", {"budget": 64, "dense_layers": 0}, None, "quest_choose"),
    "quest-group": ("quest", {"budget": 64, "dense_layers": 0, "gqa": "group"}, None, "quest_choose"),
}


def _policy(name, params, retriever):
    from kvzoo.retrievers.vestige import VestigeRetriever

    return registry.get(name, **params, **({} if retriever is None else {"retriever": VestigeRetriever(**retriever)}))


def _decode(model, policy, steps: int = 6, capacity: int | None = 240):
    """Greedy decode steps after a compressed 200-token prompt: logits, stats, the last step's trace."""
    cache = TieredCache(model, policy, capacity=capacity)
    prompt = torch.randint(3, model.config.vocab_size, (1, 200), generator=torch.Generator().manual_seed(0))
    logits = []
    with torch.no_grad():
        token = model(input_ids=prompt, cache=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
        cache.compress()
        for t in range(steps):
            position = torch.full_like(token, 200 + t)
            with StepTrace() as trace:
                out = model(input_ids=token, position_ids=position, cache=cache, use_cache=True).logits[:, -1]
            logits.append(out)
            token = out.argmax(-1, keepdim=True)
    stats = cache.stats()
    detach(model)
    return torch.stack(logits), stats, trace


@needs_compiler
@pytest.mark.parametrize("capacity", [240, None])
@pytest.mark.parametrize("arm", list(ARMS))
@pytest.mark.parametrize("model_name", ["llama", "deepseek_v2"])
def test_retrievers_take_the_op_and_keep_their_behaviour(model_name, arm, capacity, monkeypatch):
    """A decode step with the op (CPU) against the same steps on the references (``KVZOO_KERNELS=torch``): the same
    logits (to the decode attention's fp32 summation order), the same counts in ``stats()``; the step's choice is one
    launch of the op, and the layer's count is not added apart. With a fixed capacity and without (a growing index:
    Quest's page summary takes a page slot as a row opens one)."""
    name, params, retriever, op = ARMS[arm]
    model = MODELS[model_name]()[0]
    if op is None:  # the default index: int8 keys on GQA rows, the sketch on MLA rows
        op = "int8_choose" if model_name == "llama" else "sketch_choose"
    native, native_stats, trace = _decode(model, _policy(name, params, retriever), capacity=capacity)
    monkeypatch.setenv("KVZOO_KERNELS", "torch")
    reference, reference_stats, reference_trace = _decode(model, _policy(name, params, retriever), capacity=capacity)
    torch.testing.assert_close(native, reference, rtol=1e-4, atol=1e-4)
    assert native_stats.totals == reference_stats.totals
    assert [s.last_step for s in native_stats.layers] == [s.last_step for s in reference_stats.layers]
    assert native_stats.totals["fetched_rows"] > 0
    layers = sum(1 for s in native_stats.layers if s.archived_rows)
    assert trace.launch_counts[op] == layers and reference_trace.launch_counts[op] == 0
    assert trace.launches < reference_trace.launches
    if name == "quest":  # rule="eval": each step's row joins the page summary in one op, where it lies
        assert trace.launch_counts["quest_page_add"] == layers


@needs_compiler
@pytest.mark.parametrize("model_name", list(MODELS))
@pytest.mark.parametrize("name", ["vestige", "quest"])
def test_launches_per_layer_step_beyond_static_cache(model_name, name):
    """Issue 30's bound: a decode step of ``vestige`` and ``quest`` with their retrievers launches at most 15 ops per
    layer more than transformers' ``StaticCache`` (``benchmarks/decode_step.py --ops``' figure; today -6.5 .. +6.7)."""
    from transformers import StaticCache

    model = MODELS[model_name]()[0]
    prompt = torch.randint(3, model.config.vocab_size, (1, 300), generator=torch.Generator().manual_seed(0))
    detach(model)
    layers = len(TieredCache(model, "full").tiered_layers)
    detach(model)
    static = count_decode_step(model, lambda: StaticCache(config=model.config, max_cache_len=316), prompt,
                               layers=layers)
    params = {"budget": 16} if name == "vestige" else {"budget": 64, "dense_layers": 0}
    policy = registry.get(name, **params)
    kvzoo = count_decode_step(model, lambda: TieredCache(model, policy, capacity=316), prompt, layers=layers)
    detach(model)
    beyond = (kvzoo.launches - static.launches) / layers
    assert beyond <= 15, (beyond, kvzoo.trace.launch_counts)
    assert kvzoo.syncs == 0


@needs_compiler
@pytest.mark.parametrize("name", ["vestige", "quest"])
def test_a_compiled_decode_step_takes_the_ops_without_a_graph_break(name):
    """``torch._dynamo.explain`` of a tiny-Llama decode step (``capacity``) after eager steps: one graph, the kvzoo ops
    in it (their Meta impls traced; the library's availability a constant, no file read while tracing)."""
    import re

    model = tiny_llama()[0]
    params = {"budget": 16} if name == "vestige" else {"budget": 64, "dense_layers": 0}
    cache = TieredCache(model, registry.get(name, **params), capacity=320)
    prompt = torch.randint(3, model.config.vocab_size, (1, 300), generator=torch.Generator().manual_seed(0))
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            token = model(input_ids=prompt, cache=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
            cache.compress()
            for t in range(3):
                position = torch.full_like(token, 300 + t)
                out = model(input_ids=token, position_ids=position, cache=cache, use_cache=True)
                token = out.logits[:, -1].argmax(-1, keepdim=True)
            position = torch.full_like(token, 303)
            explained = torch._dynamo.explain(lambda tok, pos: model(input_ids=tok, position_ids=pos, cache=cache,
                                                                     use_cache=True).logits)(token, position)
    finally:
        torch._dynamo.reset()
        detach(model)
    assert explained.graph_count == 1, [b.reason for b in explained.break_reasons]
    ops = {op for gm in explained.graphs for op in re.findall(r"torch\.ops\.kvzoo\.(\w+)", gm.code)}
    assert ops == ({"decode_attend", "int8_choose"} if name == "vestige"
                   else {"decode_attend", "quest_choose", "quest_page_add"})
