"""Every native CPU op fed wrong inputs -- mis-shaped, strided, of the wrong dtype, on the wrong device (``meta``),
out of range -- against its PyTorch reference (issue 44: ops that read outside mis-shaped inputs).

Each case is a valid call with one thing changed; it runs three ways: the reference (the specification), the public
function (which takes the op where ``*_supported`` says so) and the raw torch op (``torch.ops.kvzoo.*``). The rule:

* the reference raises: the public function raises the reference's class or a ValueError, the raw op a ValueError
  (it checks every input once, in ``csrc/ops.cpp``, before any read);
* the reference runs: the public function gives its result; the raw op gives it too, or refuses with a ValueError
  (a dtype or layout it does not take: then ``*_supported`` is False and the public function took the reference);
* a case marked ``refuse`` (the reference has no check, and the op would read or return outside the inputs): both
  the op and the public function raise a ValueError.

The inputs the ops read in place are views into larger buffers full of NaN (``_poisoned``): a read outside the view
would change the result, so "gives the reference's result" also says nothing outside the inputs was read.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch

from kvzoo.kernels import cpu_native
from kvzoo.kernels.choose import (
    quest_choose,
    quest_choose_reference,
    quest_page_add,
    quest_page_add_reference,
    sketch_choose,
    sketch_choose_reference,
)
from kvzoo.kernels.decode_attention import Rows, attend
from kvzoo.kernels.index_scan import (
    SKETCH_SLACK,
    int8_choose,
    int8_choose_reference,
    int8_key_entries,
    int8_key_estimate,
    int8_key_estimate_reference,
    sketch_entries,
)
from kvzoo.retrievers.quest import _quest_entries

pytestmark = pytest.mark.skipif(cpu_native.toolchain_missing() is not None,
                                reason=f"{cpu_native.toolchain_missing()}: the CPU kernels are not built here")

NAN = float("nan")


@pytest.fixture(autouse=True)
def _auto(monkeypatch):
    monkeypatch.setenv("KVZOO_KERNELS", "auto")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _poisoned(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a view into a NaN buffer: 3 rows of NaN before and after each group's rows, 5 NaN columns past each
    row (the row stride is not the row's width); the last dimension contiguous, as the ops read rows."""
    *lead, n, w = t.shape
    buf = torch.full((*lead, n + 6, w + 5), NAN if t.is_floating_point() else -7, dtype=t.dtype)
    buf[..., 3:3 + n, 2:2 + w] = t
    return buf[..., 3:3 + n, 2:2 + w]


def _transposed(t: torch.Tensor) -> torch.Tensor:
    """The same values, the last two dimensions' strides swapped (the last one not contiguous)."""
    return t.transpose(-1, -2).contiguous().transpose(-1, -2)


def _strided(t: torch.Tensor) -> torch.Tensor:
    """The same values, every other element of a buffer twice as long in the last dimension."""
    buf = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
    buf[..., ::2] = t
    return buf[..., ::2]


def _meta(t):
    return t.to("meta") if isinstance(t, torch.Tensor) else t


@dataclasses.dataclass
class Outcome:
    value: object = None
    error: Exception | None = None


def _run(fn: Callable[[], object]) -> Outcome:
    try:
        return Outcome(value=fn())
    except Exception as e:  # noqa: BLE001 -- the error's class is what is judged
        return Outcome(error=e)


def _same(a, b, close: bool) -> bool:
    """Results alike: tensors equal (``close``: to fp32 rounding; NaN where the other has NaN), meta tensors of one
    shape and dtype, None for None, containers element by element."""
    if isinstance(a, (tuple, list)):
        return isinstance(b, (tuple, list)) and len(a) == len(b) and all(_same(x, y, close) for x, y in zip(a, b))
    if a is None or b is None:
        return a is None and b is None
    if not isinstance(a, torch.Tensor):
        return a == b
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_meta or b.is_meta:
        return a.is_meta and b.is_meta
    if close and a.is_floating_point():
        return torch.allclose(a, b, rtol=1e-4, atol=1e-5, equal_nan=True)
    return torch.equal(a, b) if not a.is_floating_point() else bool(((a == b) | (a.isnan() & b.isnan())).all())


def _judge(name: str, ref: Outcome, public: Outcome, raw: Outcome | None, *, refuse: bool = False,
           supported: bool | None = None, close: bool = False) -> None:
    """The module's rule (its docstring) for one case."""
    def shown(o: Outcome) -> str:
        return "ran" if o.error is None else f"{type(o.error).__name__}: {str(o.error).splitlines()[0][:160]}"

    where = f"{name}: reference {shown(ref)}; public {shown(public)}" + ("" if raw is None else f"; op {shown(raw)}")
    if refuse:
        assert isinstance(public.error, ValueError), where
        assert raw is None or isinstance(raw.error, ValueError), where
        return
    if ref.error is not None:
        assert isinstance(public.error, (ValueError, type(ref.error))), where
        assert raw is None or isinstance(raw.error, ValueError), where
        return
    assert public.error is None and _same(public.value, ref.value, close), where
    if raw is not None:
        if raw.error is None:
            assert _same(raw.value, ref.value, close), where
        else:
            assert isinstance(raw.error, ValueError) and supported is False, where


@dataclasses.dataclass
class Mutation:
    name: str
    change: Callable[[dict], None]
    refuse: bool = False


def _cases(*mutations: Mutation) -> list:
    return [pytest.param(m, id=m.name) for m in mutations]


# --- VestigeKV's sketch choice ---------------------------------------------------------------------------------------

B, G = 2, 2


def _sketch_args(dr: int = 0) -> dict:
    hq, dc, rank, m = 3, 16, 4, 40
    g = _gen(1)
    keys = torch.randn(B, G, m, dc + dr, generator=g)
    basis = torch.linalg.qr(torch.randn(B, G, dc, dc, generator=g)).Q[..., :rank].contiguous()
    entries = sketch_entries(keys[..., :dc], keys[..., dc:] if dr else None, basis)
    return {"query": torch.randn(B, G, hq, dc + dr, generator=g), "basis": basis, "entries": _poisoned(entries),
            "floor": torch.randn(B, G, hq, generator=g) * 2 + 3, "j": 4, "archived": m + 2, "scaling": 0.3,
            "slack": SKETCH_SLACK, "rank_by": "estimate", "length": torch.tensor([m, m // 2]),
            "counter": torch.tensor(5)}


def _sketch_all_meta(a: dict) -> None:
    for k in ("query", "basis", "entries", "floor", "length", "counter"):
        a[k] = _meta(a[k])


SKETCH = _cases(
    # shapes: each input's every dimension against the query's
    Mutation("entries batch 1", lambda a: a.update(entries=a["entries"][:1])),
    Mutation("entries one group", lambda a: a.update(entries=a["entries"][:, :1])),
    Mutation("entries a column short", lambda a: a.update(entries=a["entries"][..., :-1])),
    Mutation("floor [B, G]", lambda a: a.update(floor=a["floor"][..., 0])),
    Mutation("floor a row short", lambda a: a.update(floor=a["floor"][..., :2])),
    Mutation("length [1]", lambda a: a.update(length=a["length"][:1])),
    Mutation("length [B, 1]", lambda a: a.update(length=a["length"][:, None])),
    Mutation("basis one group", lambda a: a.update(basis=a["basis"][:, :1])),
    Mutation("basis batch 1", lambda a: a.update(basis=a["basis"][:1])),
    Mutation("basis a latent dim short", lambda a: a.update(basis=a["basis"][:, :, :-1])),
    Mutation("query [B, G, D]", lambda a: a.update(query=a["query"][:, :, 0])),
    Mutation("query a dim more", lambda a: a.update(query=torch.cat([a["query"], a["query"][..., :1]], -1))),
    Mutation("query 65 rows a group", lambda a: a.update(query=a["query"][:, :, :1].expand(B, G, 65, -1),
                                                          floor=a["floor"][..., :1].expand(B, G, 65))),
    # dtypes
    Mutation("query float64", lambda a: a.update(query=a["query"].double())),
    Mutation("basis float64", lambda a: a.update(basis=a["basis"].double())),
    Mutation("entries bfloat16", lambda a: a.update(entries=a["entries"].bfloat16())),
    Mutation("entries float64", lambda a: a.update(entries=a["entries"].double())),
    Mutation("floor float16", lambda a: a.update(floor=a["floor"].half())),
    Mutation("floor int64", lambda a: a.update(floor=a["floor"].long())),
    Mutation("length int32", lambda a: a.update(length=a["length"].int())),
    Mutation("length float", lambda a: a.update(length=a["length"].float())),
    Mutation("counter int32", lambda a: a.update(counter=a["counter"].int())),
    # devices
    *(Mutation(f"{k} on meta", lambda a, k=k: a.update({k: _meta(a[k])}))
      for k in ("query", "basis", "entries", "floor", "length", "counter")),
    Mutation("every tensor on meta", _sketch_all_meta),
    # strides
    Mutation("entries' last dim strided", lambda a: a.update(entries=_transposed(a["entries"]))),
    Mutation("entries' batch broadcast", lambda a: a.update(entries=a["entries"][:1].expand(B, -1, -1, -1))),
    Mutation("query transposed", lambda a: a.update(query=_transposed(a["query"]))),
    Mutation("basis transposed", lambda a: a.update(basis=_transposed(a["basis"]))),
    Mutation("basis' batch broadcast", lambda a: a.update(basis=a["basis"][:1].expand(B, -1, -1, -1))),
    Mutation("floor strided", lambda a: a.update(floor=_strided(a["floor"]))),
    Mutation("length strided", lambda a: a.update(length=_strided(a["length"]))),
    # value ranges
    Mutation("j 0", lambda a: a.update(j=0)),
    Mutation("j past the rows", lambda a: a.update(j=41)),
    Mutation("archived 0", lambda a: a.update(archived=0)),
    Mutation("archived 1", lambda a: a.update(archived=1)),
    Mutation("length past the rows", lambda a: a.update(length=torch.tensor([90, 41]))),
    Mutation("length negative", lambda a: a.update(length=torch.tensor([-1, 3]))),
    Mutation("length under j", lambda a: a.update(length=torch.tensor([2, 0]))),
    Mutation("floor -inf", lambda a: a.update(floor=torch.full_like(a["floor"], float("-inf")))),
    Mutation("rank by the bound", lambda a: a.update(rank_by="bound")),
)


def _sketch_raw(a: dict):
    return cpu_native.library().sketch_choose(a["query"], a["basis"], a["entries"], a["length"], a["floor"], a["j"],
                                              a["archived"], a["scaling"], a["slack"], a["rank_by"] == "bound",
                                              a["counter"])


def _with_counter(fn: Callable[[dict], tuple], a: dict) -> tuple:
    return (*fn(a), a["counter"])


@pytest.mark.parametrize("dr", [0, 8], ids=["gqa", "mla"])
@pytest.mark.parametrize("mutation", SKETCH)
def test_sketch_choose_takes_what_the_reference_takes(mutation, dr):
    def call(fn):
        a = _sketch_args(dr)
        mutation.change(a)
        return _run(lambda: _with_counter(fn, a))

    def kw(fn):
        return lambda a: fn(a["query"], a["basis"], a["entries"], a["floor"], a["j"], a["archived"], a["scaling"],
                            slack=a["slack"], rank_by=a["rank_by"], length=a["length"], counter=a["counter"])

    a = _sketch_args(dr)
    mutation.change(a)
    supported = _run(lambda: cpu_native.sketch_choose_supported(a["query"], a["basis"], a["entries"], a["floor"],
                                                                 a["j"], a["counter"]))
    _judge(mutation.name, call(kw(sketch_choose_reference)), call(kw(sketch_choose)), call(_sketch_raw),
           refuse=mutation.refuse, supported=supported.value if supported.error is None else False)


# --- Quest's page choice ---------------------------------------------------------------------------------------------

QD, QP, QSIZE, QLIVE, QM, QN = 8, 10, 4, 30, 47, 40


def _quest_args(per_head: bool, own: bool) -> dict:
    hq = 3
    g = _gen(2)
    keys = torch.randn(B, G, QP * QSIZE, QD, generator=g)
    valid = (torch.arange(QP * QSIZE) < QLIVE).expand(B, G, -1).clone()
    valid[:, :, 2 * QSIZE:3 * QSIZE] = False  # a page of padding rows
    lo = keys.masked_fill(~valid[..., None], float("inf")).view(B, G, QP, QSIZE, QD).amin(3)
    hi = keys.masked_fill(~valid[..., None], float("-inf")).view(B, G, QP, QSIZE, QD).amax(3)
    entries = _quest_entries(lo, hi, torch.float32)["entries"]
    empty = torch.isinf(lo).all(-1) & torch.isinf(hi).all(-1)
    positions = torch.stack([torch.randperm(QM, generator=g) for _ in range(B * G)]).view(B, G, QM)
    a = {"query": torch.randn(B, G, hq, QD, generator=g), "entries": _poisoned(entries), "empty": empty,
         "live": torch.tensor([QLIVE]), "positions": positions, "pages": 3, "size": QSIZE, "archived": QM,
         "scaling": 0.7, "per_head": per_head, "counter": torch.tensor(3), "own": None}
    if own:
        storage = torch.randn(B, G, QN, QD, generator=g)
        earlier = torch.randn(B, G, 2, QD, generator=g)
        a["own"] = [_poisoned(storage), torch.ones(B, G, QN, dtype=torch.bool),
                    torch.randint(0, QN, (B, G), generator=g), earlier.amin(2), earlier.amax(2)]
    return a


def _own(a: dict, i: int, value) -> None:
    if a["own"] is not None:
        a["own"][i] = value(a["own"][i])


def _quest_all_meta(a: dict) -> None:
    for k in ("query", "entries", "empty", "live", "positions", "counter"):
        a[k] = _meta(a[k])
    if a["own"] is not None:
        a["own"] = [_meta(t) for t in a["own"]]


QUEST = _cases(
    # shapes
    Mutation("entries batch 1", lambda a: a.update(entries=a["entries"][:1])),
    Mutation("entries one group", lambda a: a.update(entries=a["entries"][:, :1])),
    Mutation("entries a column short", lambda a: a.update(entries=a["entries"][..., :-1])),
    Mutation("empty a page short", lambda a: a.update(empty=a["empty"][..., :-1])),
    Mutation("empty [B, G]", lambda a: a.update(empty=a["empty"][..., 0])),
    Mutation("positions one group", lambda a: a.update(positions=a["positions"][:, :1])),
    Mutation("positions [B, M]", lambda a: a.update(positions=a["positions"][:, 0])),
    Mutation("live of two elements", lambda a: a.update(live=torch.tensor([QLIVE, QLIVE]))),
    Mutation("live 0-dim", lambda a: a.update(live=torch.tensor(QLIVE))),
    Mutation("query [B, G, D]", lambda a: a.update(query=a["query"][:, :, 0])),
    Mutation("query a dim more", lambda a: a.update(query=torch.cat([a["query"], a["query"][..., :1]], -1))),
    Mutation("query 65 heads a group", lambda a: a.update(query=a["query"][:, :, :1].expand(B, G, 65, -1))),
    Mutation("own keys a dim short", lambda a: _own(a, 0, lambda t: t[..., :-1])),
    Mutation("own valid a row short", lambda a: _own(a, 1, lambda t: t[..., :-1])),
    Mutation("own position [B]", lambda a: _own(a, 2, lambda t: t[:, 0])),
    Mutation("open_min a dim short", lambda a: _own(a, 3, lambda t: t[..., :-1])),
    # dtypes
    Mutation("query float64", lambda a: a.update(query=a["query"].double())),
    Mutation("entries float64", lambda a: a.update(entries=a["entries"].double())),
    Mutation("empty uint8", lambda a: a.update(empty=a["empty"].to(torch.uint8))),
    Mutation("live int32", lambda a: a.update(live=a["live"].int())),
    Mutation("positions int32", lambda a: a.update(positions=a["positions"].int())),
    Mutation("counter int32", lambda a: a.update(counter=a["counter"].int())),
    Mutation("own keys float16", lambda a: _own(a, 0, lambda t: t.half())),
    Mutation("own valid uint8", lambda a: _own(a, 1, lambda t: t.to(torch.uint8))),
    Mutation("own position int32", lambda a: _own(a, 2, lambda t: t.int())),
    Mutation("open_min float64", lambda a: _own(a, 3, lambda t: t.double())),
    # devices
    *(Mutation(f"{k} on meta", lambda a, k=k: a.update({k: _meta(a[k])}))
      for k in ("query", "entries", "empty", "live", "positions", "counter")),
    Mutation("own keys on meta", lambda a: _own(a, 0, _meta)),
    Mutation("open_max on meta", lambda a: _own(a, 4, _meta)),
    Mutation("every tensor on meta", _quest_all_meta),
    # strides
    Mutation("entries' last dim strided", lambda a: a.update(entries=_transposed(a["entries"]))),
    Mutation("empty strided", lambda a: a.update(empty=_strided(a["empty"]))),
    Mutation("positions strided", lambda a: a.update(positions=_strided(a["positions"]))),
    Mutation("live strided", lambda a: a.update(live=_strided(a["live"]))),
    Mutation("query transposed", lambda a: a.update(query=_transposed(a["query"]))),
    Mutation("own keys' last dim strided", lambda a: _own(a, 0, _transposed)),
    Mutation("own valid strided", lambda a: _own(a, 1, _strided)),
    Mutation("own position strided", lambda a: _own(a, 2, _strided)),
    Mutation("open_min transposed", lambda a: _own(a, 3, lambda t: _transposed(t[:, :, None])[:, :, 0])),
    Mutation("open_max strided", lambda a: _own(a, 4, _strided)),
    # value ranges
    Mutation("live 0", lambda a: a.update(live=torch.tensor([0])), refuse=True),
    Mutation("live negative", lambda a: a.update(live=torch.tensor([-3])), refuse=True),
    Mutation("live past the pages", lambda a: a.update(live=torch.tensor([QP * QSIZE + 1]))),
    Mutation("live far past the pages", lambda a: a.update(live=torch.tensor([1000]), positions=None)),
    Mutation("archive list shorter than live", lambda a: a.update(positions=a["positions"][..., :QLIVE - 2]),
             refuse=True),
    Mutation("archive list as long as live, not archived", lambda a: a.update(positions=a["positions"][..., :QLIVE]),
             refuse=True),
    Mutation("archive list as long as archived", lambda a: a.update(positions=a["positions"][..., :QLIVE],
                                                                    archived=QLIVE)),
    Mutation("archived under live", lambda a: a.update(archived=QLIVE - 5), refuse=True),
    Mutation("pages 0", lambda a: a.update(pages=0)),
    Mutation("pages past the slots", lambda a: a.update(pages=QP + 2)),
    Mutation("every page", lambda a: a.update(pages=QP)),
    Mutation("size 0", lambda a: a.update(size=0)),
    Mutation("archived 0", lambda a: a.update(archived=0)),
    Mutation("own position past the storage", lambda a: _own(a, 2, lambda t: t + QN)),
    Mutation("own position negative", lambda a: _own(a, 2, lambda t: t - QN)),
    Mutation("own row padding", lambda a: _own(a, 1, lambda t: torch.zeros_like(t))),
    # equal bounds above -inf: both rank NaN as +inf and take an earlier page first among equals (issue 44, minor)
    Mutation("query NaN", lambda a: a["query"].__setitem__((0, 0, 0, 0), NAN)),
    Mutation("query inf", lambda a: a["query"].__setitem__((1, 1, 2, 3), float("inf"))),
)


def _quest_raw(a: dict):
    own = a["own"] or [None] * 5
    rows, at, valid, count = cpu_native.library().quest_choose(
        a["query"], a["entries"], a["empty"], a["live"], a["positions"], a["pages"], a["size"], a["archived"],
        a["per_head"], a["scaling"], SKETCH_SLACK, a["counter"], *own)
    return rows, at if a["positions"] is not None else None, valid, count


@pytest.mark.parametrize("own", [False, True], ids=["", "own"])
@pytest.mark.parametrize("per_head", [True, False], ids=["head", "group"])
@pytest.mark.parametrize("mutation", QUEST)
def test_quest_choose_takes_what_the_reference_takes(mutation, per_head, own):
    def call(fn):
        a = _quest_args(per_head, own)
        mutation.change(a)
        return _run(lambda: _with_counter(fn, a))

    def kw(fn):
        return lambda a: fn(a["query"], a["entries"], a["empty"], a["live"], a["positions"], a["pages"], a["size"],
                            a["archived"], a["scaling"], per_head=a["per_head"], counter=a["counter"],
                            own=None if a["own"] is None else tuple(a["own"]))

    a = _quest_args(per_head, own)
    mutation.change(a)
    supported = _run(lambda: cpu_native.quest_choose_supported(
        a["query"], a["entries"], a["empty"], a["live"], a["positions"], a["counter"],
        None if a["own"] is None else tuple(a["own"])))
    _judge(mutation.name, call(kw(quest_choose_reference)), call(kw(quest_choose)), call(_quest_raw),
           refuse=mutation.refuse, supported=supported.value if supported.error is None else False)


# --- Quest's one-row page add ----------------------------------------------------------------------------------------

AP = 6  # page slots


def _page_add_args() -> dict:
    g = _gen(3)
    earlier = torch.randn(B, G, 3, QD, generator=g)
    return {"keys": _poisoned(torch.randn(B, G, QN, QD, generator=g)), "valid": torch.rand(B, G, QN, generator=g) > 0.2,
            "position": torch.randint(0, QN, (B, G), generator=g), "open_min": earlier.amin(2),
            "open_max": earlier.amax(2), "entries": _poisoned(torch.zeros(B, G, AP, 2 * QD + 1)),
            "empty": torch.ones(B, G, AP, dtype=torch.bool), "count": torch.tensor([5]), "length": torch.tensor([2]),
            "size": QSIZE}


STATE = ("open_min", "open_max", "entries", "empty", "count", "length")


def _page_add_all_meta(a: dict) -> None:
    for k, v in a.items():
        a[k] = _meta(v)


PAGE_ADD = _cases(
    # shapes
    Mutation("keys [B, G, N]", lambda a: a.update(keys=a["keys"][..., 0])),
    Mutation("keys batch 1", lambda a: a.update(keys=a["keys"][:1])),
    Mutation("valid a row short", lambda a: a.update(valid=a["valid"][..., :-1])),
    Mutation("position [B]", lambda a: a.update(position=a["position"][:, 0])),
    Mutation("open_min a dim short", lambda a: a.update(open_min=a["open_min"][..., :-1])),
    Mutation("entries a column short", lambda a: a.update(entries=a["entries"][..., :-1])),
    Mutation("entries batch 1", lambda a: a.update(entries=a["entries"][:1])),
    Mutation("empty a page short", lambda a: a.update(empty=a["empty"][..., :-1])),
    Mutation("count of two elements", lambda a: a.update(count=torch.tensor([5, 5]))),
    Mutation("count 0-dim", lambda a: a.update(count=torch.tensor(5))),
    # dtypes
    Mutation("keys and entries float64", lambda a: a.update(keys=a["keys"].double(), entries=a["entries"].double())),
    Mutation("entries float16 for float32 keys", lambda a: a.update(entries=a["entries"].half())),
    Mutation("valid uint8", lambda a: a.update(valid=a["valid"].to(torch.uint8))),
    Mutation("position int32", lambda a: a.update(position=a["position"].int())),
    Mutation("count int32", lambda a: a.update(count=a["count"].int())),
    Mutation("open_min float64", lambda a: a.update(open_min=a["open_min"].double())),
    Mutation("empty uint8", lambda a: a.update(empty=a["empty"].to(torch.uint8))),
    # devices
    *(Mutation(f"{k} on meta", lambda a, k=k: a.update({k: _meta(a[k])}))
      for k in ("keys", "valid", "position", "open_min", "entries", "count")),
    Mutation("every tensor on meta", _page_add_all_meta),
    # strides
    Mutation("keys' last dim strided", lambda a: a.update(keys=_transposed(a["keys"]))),
    Mutation("entries' last dim strided", lambda a: a.update(entries=_transposed(a["entries"]))),
    Mutation("valid strided", lambda a: a.update(valid=_strided(a["valid"]))),
    Mutation("position strided", lambda a: a.update(position=_strided(a["position"]))),
    Mutation("empty strided", lambda a: a.update(empty=_strided(a["empty"]))),
    Mutation("open_min strided", lambda a: a.update(open_min=_strided(a["open_min"]))),
    # value ranges
    Mutation("size 0", lambda a: a.update(size=0)),
    Mutation("size negative", lambda a: a.update(size=-2)),
    Mutation("position past the storage", lambda a: a.update(position=a["position"] + QN)),
    Mutation("position negative", lambda a: a.update(position=a["position"] - QN)),
    Mutation("count at a full summary", lambda a: a.update(count=torch.tensor([AP * QSIZE]))),
    Mutation("count negative", lambda a: a.update(count=torch.tensor([-1]))),
    Mutation("count at the last row", lambda a: a.update(count=torch.tensor([AP * QSIZE - 1]))),
    Mutation("count opening a page", lambda a: a.update(count=torch.tensor([8]))),
    Mutation("a padding row", lambda a: a.update(valid=torch.zeros_like(a["valid"]))),
)


def _page_add_call(fn: Callable) -> Callable[[dict], tuple]:
    def call(a: dict) -> tuple:
        fn(a["keys"], a["valid"], a["position"], a["open_min"], a["open_max"], a["entries"], a["empty"], a["count"],
           a["length"], a["size"])
        return tuple(a[k] for k in STATE)
    return call


@pytest.mark.parametrize("mutation", PAGE_ADD)
def test_quest_page_add_takes_what_the_reference_takes(mutation):
    def call(fn):
        a = _page_add_args()
        mutation.change(a)
        return _run(lambda: _page_add_call(fn)(a))

    a = _page_add_args()
    mutation.change(a)
    supported = _run(lambda: cpu_native.quest_page_add_supported(*(a[k] for k in (
        "keys", "valid", "position", "open_min", "open_max", "entries", "empty", "count", "length"))))
    _judge(mutation.name, call(quest_page_add_reference), call(quest_page_add),
           call(cpu_native.library().quest_page_add), refuse=mutation.refuse,
           supported=supported.value if supported.error is None else False)


# --- decode attention ------------------------------------------------------------------------------------------------

DH, DG, DN, DD, DK = 6, 2, 20, 8, 12


def _decode_args(H: int = DH, groups: int = DG) -> dict:
    g = _gen(4)
    indices = torch.randint(0, DN, (B, groups, DK), generator=g)
    indices[0, 0, 1], indices[1, -1, 4] = -1, DN + 3  # unreadable entries: nothing read outside the pool
    return {"query": torch.randn(B, H, DD, generator=g), "keys": _poisoned(torch.randn(B, groups, DN, DD, generator=g)),
            "values": _poisoned(torch.randn(B, groups, DN, DD, generator=g)), "value_width": None,
            "indices": indices, "length": torch.tensor([DK - 2, DK]),
            "valid": torch.rand(B, groups, DK, generator=g) > 0.2,
            "pool_valid": torch.rand(B, groups, DN, generator=g) > 0.1,
            "head_valid": torch.rand(B, H, DK, generator=g) > 0.3}


def _decode_all_meta(a: dict) -> None:
    for k, v in a.items():
        a[k] = _meta(v)


DECODE = _cases(
    # shapes
    Mutation("keys batch 1", lambda a: a.update(keys=a["keys"][:1])),
    Mutation("keys a dim more", lambda a: a.update(keys=torch.cat([a["keys"], a["keys"][..., :1]], -1))),
    Mutation("keys [B, G, N]", lambda a: a.update(keys=a["keys"][..., 0])),
    Mutation("values a row short", lambda a: a.update(values=a["values"][:, :, :-1])),
    Mutation("values one group", lambda a: a.update(values=a["values"][:, :1])),
    Mutation("indices one group", lambda a: a.update(indices=a["indices"][:, :1])),
    Mutation("indices [B, K]", lambda a: a.update(indices=a["indices"][:, 0])),
    Mutation("length [1]", lambda a: a.update(length=a["length"][:1])),
    Mutation("valid a position short", lambda a: a.update(valid=a["valid"][..., :-1])),
    Mutation("pool_valid a row short", lambda a: a.update(pool_valid=a["pool_valid"][..., :-1])),
    Mutation("head_valid a head short", lambda a: a.update(head_valid=a["head_valid"][:, :-1])),
    Mutation("query [B, D]", lambda a: a.update(query=a["query"][:, 0])),
    Mutation("heads not a multiple of the groups", lambda a: a.update(query=a["query"][:, :-1],
                                                                      head_valid=a["head_valid"][:, :-1])),
    Mutation("absorbed, value_width past D", lambda a: a.update(values=None, value_width=DD + 1)),
    Mutation("absorbed, value_width 0", lambda a: a.update(values=None, value_width=0)),
    Mutation("absorbed", lambda a: a.update(values=None, value_width=DD - 3)),
    Mutation("values of width 0", lambda a: a.update(values=a["values"][..., :0])),
    # dtypes
    Mutation("keys float64", lambda a: a.update(keys=a["keys"].double(), values=a["values"].double())),
    Mutation("values float16 for float32 keys", lambda a: a.update(values=a["values"].half())),
    Mutation("query float64", lambda a: a.update(query=a["query"].double())),
    Mutation("keys bfloat16", lambda a: a.update(keys=a["keys"].bfloat16(), values=a["values"].bfloat16())),
    Mutation("indices float", lambda a: a.update(indices=a["indices"].float())),
    Mutation("indices int32", lambda a: a.update(indices=a["indices"].int())),
    Mutation("length float", lambda a: a.update(length=a["length"].float())),
    Mutation("valid uint8", lambda a: a.update(valid=a["valid"].to(torch.uint8))),
    Mutation("head_valid int64", lambda a: a.update(head_valid=a["head_valid"].long())),
    # devices
    *(Mutation(f"{k} on meta", lambda a, k=k: a.update({k: _meta(a[k])}))
      for k in ("keys", "values", "indices", "length", "valid", "pool_valid", "head_valid")),
    Mutation("every tensor on meta", _decode_all_meta),
    # strides
    Mutation("keys' last dim strided", lambda a: a.update(keys=_transposed(a["keys"]))),
    Mutation("values' last dim strided", lambda a: a.update(values=_transposed(a["values"]))),
    Mutation("query transposed", lambda a: a.update(query=_transposed(a["query"]))),
    Mutation("indices strided", lambda a: a.update(indices=_strided(a["indices"]))),
    Mutation("valid strided", lambda a: a.update(valid=_strided(a["valid"]))),
    Mutation("head_valid transposed", lambda a: a.update(head_valid=_transposed(a["head_valid"]))),
    Mutation("length strided", lambda a: a.update(length=_strided(a["length"]))),
    Mutation("keys' batch broadcast", lambda a: a.update(keys=a["keys"][:1].expand(B, -1, -1, -1))),
    # value ranges
    Mutation("indices far outside the pool", lambda a: a.update(indices=a["indices"] * 1000 - 7)),
    Mutation("length past the positions", lambda a: a.update(length=torch.tensor([DK + 9, 3 * DK]))),
    Mutation("length negative", lambda a: a.update(length=torch.tensor([-4, 2]))),
    Mutation("nothing readable", lambda a: a.update(valid=torch.zeros_like(a["valid"]))),
    Mutation("65 heads a group", lambda a: a.update(**_decode_args(65, 1))),
    Mutation("130 heads a group", lambda a: a.update(**_decode_args(130, 1))),
)


def _rows(a: dict) -> Rows:
    return Rows(a["keys"], a["values"], value_width=a["value_width"], valid=a["valid"], length=a["length"],
                indices=a["indices"], head_valid=a["head_valid"], pool_valid=a["pool_valid"])


def _decode_raw(a: dict):
    width = a["values"].shape[-1] if a["values"] is not None else a["value_width"]
    out, lse, _, _ = cpu_native.library().decode_attend(a["query"], a["keys"], a["values"], width, a["indices"],
                                                        a["length"], a["valid"], a["pool_valid"], a["head_valid"],
                                                        0.3, None, None, False, False)
    return out, lse


@pytest.mark.parametrize("mutation", DECODE)
def test_decode_attend_takes_what_the_reference_takes(mutation):
    def call(fn):
        a = _decode_args()
        mutation.change(a)
        return _run(lambda: fn(a))

    def public(impl):
        def part(a):
            got = attend(a["query"], [_rows(a)], 0.3, lse=True, impl=impl)
            return got.out.float(), got.lse
        return part

    a = _decode_args()
    mutation.change(a)
    supported = _run(lambda: cpu_native.decode_attend_supported(a["query"], _rows(a)))
    _judge(mutation.name, call(public("reference")), call(public("native")), call(_decode_raw), close=True,
           refuse=mutation.refuse, supported=supported.value if supported.error is None else False)


# --- VestigeKV's int8 index: its public functions only (the ops are another change's) --------------------------------


def _int8_args() -> dict:
    g = _gen(5)
    hq, D, m = 3, 16, 40
    codes, side = int8_key_entries(torch.randn(B, G, m, D, generator=g))
    return {"query": torch.randn(B, G, hq, D, generator=g), "codes": _poisoned(codes), "side": _poisoned(side),
            "threshold": torch.randn(B, G, hq, generator=g), "j": 4, "archived": m + 2, "scaling": 0.3,
            "length": torch.tensor([m, m // 2]), "counter": torch.tensor(2)}


INT8 = _cases(
    Mutation("codes batch 1", lambda a: a.update(codes=a["codes"][:1])),
    Mutation("side a row short", lambda a: a.update(side=a["side"][:, :, :-1])),
    Mutation("side one group", lambda a: a.update(side=a["side"][:, :1])),
    Mutation("threshold [B, G]", lambda a: a.update(threshold=a["threshold"][..., 0])),
    Mutation("length [1]", lambda a: a.update(length=a["length"][:1])),
    Mutation("query a dim more", lambda a: a.update(query=torch.cat([a["query"], a["query"][..., :8]], -1))),
    Mutation("codes int16", lambda a: a.update(codes=a["codes"].short())),
    Mutation("side float32", lambda a: a.update(side=a["side"].float())),
    Mutation("threshold float64", lambda a: a.update(threshold=a["threshold"].double())),
    Mutation("length float", lambda a: a.update(length=a["length"].float())),
    Mutation("codes on meta", lambda a: a.update(codes=_meta(a["codes"]))),
    Mutation("threshold on meta", lambda a: a.update(threshold=_meta(a["threshold"]))),
    Mutation("codes' last dim strided", lambda a: a.update(codes=_transposed(a["codes"]))),
    Mutation("query transposed", lambda a: a.update(query=_transposed(a["query"]))),
    Mutation("threshold strided", lambda a: a.update(threshold=_strided(a["threshold"]))),
    Mutation("j 0", lambda a: a.update(j=0)),
    Mutation("j past the rows", lambda a: a.update(j=41)),
    Mutation("length past the rows", lambda a: a.update(length=torch.tensor([90, 41]))),
    Mutation("length negative", lambda a: a.update(length=torch.tensor([-1, 3]))),
)


@pytest.mark.parametrize("mutation", INT8)
def test_int8_functions_take_what_their_references_take(mutation):
    def call(fn):
        a = _int8_args()
        mutation.change(a)
        return _run(lambda: fn(a))

    def choose(fn):
        return lambda a: (*fn(a["query"], a["codes"], a["side"], a["threshold"], a["j"], a["archived"], a["scaling"],
                             length=a["length"], counter=a["counter"]), a["counter"])

    def estimate(fn):
        return lambda a: fn(a["query"], a["codes"], a["side"], a["scaling"], length=a["length"])

    _judge(f"{mutation.name} (int8_choose)", call(choose(int8_choose_reference)), call(choose(int8_choose)), None)
    _judge(f"{mutation.name} (int8_key_estimate)", call(estimate(int8_key_estimate_reference)),
           call(estimate(int8_key_estimate)), None, close=True)


def test_quest_choose_random_cases_match_the_reference():
    """400 random choices -- padding rows, a page of padding inside ``live``, more pages asked than hold rows, the
    step's own row or not: the op picks, flags, places and counts what the reference does (issue 44: it broke ties
    among empty pages toward a padding page inside ``live`` where ``torch.topk`` took a later one, and counted that
    page's rows); an empty page's rows are never valid. With NaN or an infinity in the query (equal bounds above
    ``-inf``) the same: both rank NaN as ``+inf`` and take an earlier page first among equals. A third of the cases
    have shifted pages (a padded batch's: page ``p`` holds rows ``p x size - shift`` on)."""
    for seed in range(400):
        g = _gen(seed)

        def draw(lo: int, hi: int, g: torch.Generator = g) -> int:
            return int(torch.randint(lo, hi + 1, (1,), generator=g))

        b, groups, hq, D, size, P = draw(1, 2), draw(1, 2), draw(1, 4), draw(1, 8), draw(1, 5), draw(1, 8)
        live, own = draw(1, P * size), draw(0, 1) == 1
        keys = torch.randn(b, groups, P * size, D, generator=g)
        valid = (torch.arange(P * size) < live) & (torch.rand(b, groups, P * size, generator=g) > draw(0, 1) * 0.5)
        if draw(0, 1):
            page = draw(0, P - 1)
            valid[:, :, page * size:(page + 1) * size] = False
        lo = keys.masked_fill(~valid[..., None], float("inf")).view(b, groups, P, size, D).amin(3)
        hi = keys.masked_fill(~valid[..., None], float("-inf")).view(b, groups, P, size, D).amax(3)
        entries = _quest_entries(lo, hi, torch.float32)["entries"]
        empty = torch.isinf(lo).all(-1) & torch.isinf(hi).all(-1)
        query = torch.randn(b, groups, hq, D, generator=g)
        odd = draw(0, 3)
        if odd:
            query[0, 0, 0, 0] = (NAN, float("inf"), float("-inf"))[odd - 1]
        M = P * size + 3
        positions = torch.stack([torch.randperm(M, generator=g) for _ in range(b * groups)]).view(b, groups, M)
        extra = None
        if own and live // size <= P:
            storage = torch.randn(b, groups, 9, D, generator=g)
            earlier = torch.randn(b, groups, 2, D, generator=g)
            extra = (storage, torch.rand(b, groups, 9, generator=g) > 0.3, torch.randint(0, 9, (b, groups),
                     generator=g), earlier.amin(2), earlier.amax(2))
        pages = draw(1, P + (extra is not None))
        shift = None  # a padded batch's pages (issue 44 item 2): virtual rows before each archive
        if draw(0, 2) == 0:
            shift = torch.randint(0, size, (b, groups), generator=g)
            if extra is not None and (live + int(shift.max())) // size > P:
                shift = None
        for per_head in (True, False):
            args = (query, entries, empty, torch.tensor([live]), positions, pages, size, M, 0.5)
            counter, ref_counter = torch.tensor(0), torch.tensor(0)
            got = quest_choose(*args, per_head=per_head, own=extra, counter=counter, shift=shift)
            want = quest_choose_reference(*args, per_head=per_head, own=extra, counter=ref_counter, shift=shift)
            # NaN or an infinity in the query: equal bounds above -inf, broken alike (an earlier page first)
            assert _same(got, want, close=False) and int(counter) == int(ref_counter), (seed, per_head, odd)
            for rows, _, ok, count in (got, want):
                if extra is None:  # (the own row's page: its flag is the op's to compute)
                    page = rows // size if shift is None else (rows + shift[..., None]) // size
                    assert not empty.gather(2, page.clamp(max=P - 1))[ok].any(), (seed, per_head)
                assert (rows[ok] < live).all() and int(count) <= int(ok.sum()), (seed, per_head)
