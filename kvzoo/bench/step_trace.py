"""What one decode step launches and enters: the checks that a step could be a CUDA graph, and its host cost.

:class:`StepTrace` records each aten op a step dispatches, the ones that launch work, make the host wait or build
tensors from host data; :class:`HostCalls` counts the kvzoo Python functions a step enters, per file and function.
``tests/test_host_cost.py`` holds the bounds and ``benchmarks/decode_step.py`` reports both. :class:`StandInGraph`
stands in for a CUDA graph on CPU (strict: refusing a captured step that syncs or builds host tensors).
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

# ops that only make a new view of existing storage (or read metadata): they launch no work
METADATA_OPS = frozenset({
    "view", "_unsafe_view", "reshape", "alias", "as_strided", "slice", "select", "narrow", "t", "transpose",
    "permute", "expand", "expand_as", "unsqueeze", "squeeze", "detach", "split", "split_with_sizes", "unbind",
    "chunk", "view_as", "unflatten", "flatten", "movedim", "diagonal", "lift_fresh", "_reshape_alias",
    "view_as_real", "view_as_complex", "unfold", "real", "imag", "_conj", "conj", "resolve_conj", "resolve_neg",
    "_neg_view", "is_same_size", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "dim", "size",
    "stride", "storage_offset", "numel", "is_contiguous", "_has_compatible_shallow_copy_type", "empty_like_meta",
})
# ops that make the host wait for the device (or whose output shape depends on the data)
SYNC_OPS = frozenset({
    "_local_scalar_dense", "item", "nonzero", "nonzero_static", "masked_select", "unique", "_unique", "_unique2",
    "unique_consecutive", "unique_dim", "repeat_interleave_tensor", "argwhere", "_assert_async_msg_sync",
})


def _base(op: Any) -> str:
    name = op.name() if hasattr(op, "name") else str(op)
    return name.split("::")[-1].split(".")[0]


def _describe(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return ("T", tuple(value.shape), str(value.dtype))
    if isinstance(value, (list, tuple)):
        return tuple(_describe(v) for v in value)
    if isinstance(value, (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout,
                          torch.memory_format)):
        return value
    return type(value).__name__


@dataclass
class StepTrace(TorchDispatchMode):
    """Records every aten op dispatched while active (``with StepTrace() as trace: ...``)."""

    ops: list[tuple[str, Any]] = field(default_factory=list)
    launches: int = 0
    syncs: list[str] = field(default_factory=list)
    host_tensors: list[tuple[int, ...]] = field(default_factory=list)  # shapes of tensors made from host data
    storages: set[int] = field(default_factory=set)  # data pointers of every tensor an op wrote or read

    def __post_init__(self) -> None:
        super().__init__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _base(func)
        self.ops.append((str(func), _describe(args), _describe(kwargs)))
        if name not in METADATA_OPS:
            self.launches += 1
        if name in SYNC_OPS or (name == "repeat_interleave" and args and isinstance(args[0], torch.Tensor)
                                and len(args) > 1 and isinstance(args[1], torch.Tensor)):
            self.syncs.append(name)
        if name == "lift_fresh" and args and isinstance(args[0], torch.Tensor) and args[0].dim() > 0:
            self.host_tensors.append(tuple(args[0].shape))
        for t in tree_flatten((args, kwargs))[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                try:
                    self.storages.add(t.untyped_storage().data_ptr())
                except RuntimeError:
                    pass
        return func(*args, **kwargs)

    @property
    def launch_counts(self) -> Counter:
        """Launched ops by name (metadata ops left out)."""
        return Counter(_base_name(op) for op, _, _ in self.ops if _base_name(op) not in METADATA_OPS)


def _base_name(qualified: str) -> str:
    """``aten.index_copy_.default`` -> ``index_copy_``."""
    parts = qualified.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def first_difference(a: StepTrace, b: StepTrace) -> str | None:
    """Where two traces differ (None when they are the same op for op): the index and both ops."""
    for i, (x, y) in enumerate(zip(a.ops, b.ops)):
        if x != y:
            return f"op {i}: {x} != {y}"
    if len(a.ops) != len(b.ops):
        return f"{len(a.ops)} ops != {len(b.ops)} ops"
    return None


# --- one decode step of a model with a given cache ----------------------------------------------------------


@dataclass
class StepCount:
    """One steady decode step: what it launched and how often it waited for the device."""

    launches: int
    syncs: int
    layers: int  # the attention layers the cache handles (Kimi Linear: the MLA layers)
    trace: StepTrace

    @property
    def per_layer(self) -> float:
        return self.launches / max(1, self.layers)


def count_decode_step(model: torch.nn.Module, make_cache, prompt: torch.Tensor, *, layers: int,
                      warmup: int = 3) -> StepCount:
    """Prefill ``prompt [B, T]`` into ``make_cache()``, compress it (a kvzoo cache), run ``warmup`` decode steps,
    then count one more. Positions are passed as tensors (what a captured step does)."""
    trace = steady_step(model, make_cache(), prompt, StepTrace(), warmup=warmup)
    return StepCount(trace.launches, len(trace.syncs), layers, trace)


def steady_step(model: torch.nn.Module, cache: Any, prompt: torch.Tensor, watch: Any, *, warmup: int = 3) -> Any:
    """Prefill ``prompt [B, T]`` into ``cache``, compress it (a kvzoo cache), run ``warmup`` decode steps, then one
    more inside ``watch`` (a context manager: :class:`StepTrace`, :class:`HostCalls`), which it returns."""
    T = prompt.shape[1]
    with torch.no_grad():
        logits = model(input_ids=prompt, cache=cache, use_cache=True).logits[:, -1]
        if hasattr(cache, "compress"):
            cache.compress()
        token = logits.argmax(-1, keepdim=True)
        for t in range(warmup + 1):
            position = torch.full_like(token, T + t)
            if t == warmup:
                with watch:
                    model(input_ids=token, position_ids=position, cache=cache, use_cache=True)
            else:
                token = model(input_ids=token, position_ids=position, cache=cache,
                              use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
    return watch


# --- a CUDA graph's stand-in on CPU ----------------------------------------------------------------------------


class CaptureError(RuntimeError):
    """A step captured by a strict :class:`StandInGraph` did what ``torch.cuda.graph`` capture refuses: waited for
    the device, or built a tensor from host data (a host-to-device copy)."""


class StandInGraph:
    """A CUDA graph's stand-in on CPU (``graphs.install(model, cache, lambda: StandInGraph(cache))``): ``capture``
    runs the step once (on a GPU capture records it and the replay right after runs it); a later ``replay`` re-runs
    the step with the host's numbers put back afterwards (a graph replays device work only: the host's counters are
    the DecodeGraph's to advance) and writes its logits into the captured output, as a graph's static output would be.

    ``strict``: the captured step runs under :class:`StepTrace`, and a step that synchronises or builds a tensor from
    host data -- what capture on a GPU would refuse, or record wrongly -- raises :class:`CaptureError`."""

    def __init__(self, cache: Any, strict: bool = False) -> None:
        self.graph, self.fn, self.fresh, self.strict = cache.graph, None, False, strict

    def warm(self, fn):
        return fn()

    def capture(self, fn):
        self.fn, self.fresh = fn, True
        if not self.strict:
            self.out = fn()
            return self.out
        with StepTrace() as trace:
            self.out = fn()
        found = ([f"ops that wait for the device {trace.syncs}"] if trace.syncs else []) + (
            [f"tensors built from host data, shapes {trace.host_tensors}"] if trace.host_tensors else [])
        if found:
            raise CaptureError(f"the captured decode step has {' and '.join(found)}: torch.cuda.graph capture refuses "
                               "a sync and would replay a host tensor's copy as it was at capture. Keep what a step "
                               "reads on the device (see kvzoo.bench.step_trace.StepTrace to find the op)")
        return self.out

    def replay(self) -> None:
        from kvzoo.framework.graphs import HostNumbers

        if self.fresh:  # the capture ran it already
            self.fresh = False
            return
        roots = self.graph.host_state()
        before = HostNumbers.snapshot(roots)
        logits = self.fn()["logits"]
        for path, value in before.items():
            HostNumbers._set(roots, path, value)
        self.out["logits"].copy_(logits)


# --- the kvzoo functions a step enters ---------------------------------------------------------------------------

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # kvzoo/


@dataclass
class HostCalls:
    """Python function entries in the kvzoo package while active (``with HostCalls() as calls: ...``): ``by_file``
    (paths relative to the package) and ``by_function`` (``file:function``). Not re-entrant; replaces (and then
    restores) any profile hook already set."""

    by_file: Counter = field(default_factory=Counter)
    by_function: Counter = field(default_factory=Counter)

    def _hook(self, frame, event, arg) -> None:
        if event == "call":
            path = frame.f_code.co_filename
            if path.startswith(_PACKAGE) and path != __file__:  # not the tracer's own __exit__
                name = os.path.relpath(path, _PACKAGE)
                self.by_file[name] += 1
                self.by_function[f"{name}:{frame.f_code.co_name}"] += 1

    def __enter__(self) -> HostCalls:
        self._previous = sys.getprofile()
        sys.setprofile(self._hook)
        return self

    def __exit__(self, *exc) -> None:
        sys.setprofile(self._previous)

    @property
    def total(self) -> int:
        return sum(self.by_file.values())


def count_host_calls(model: torch.nn.Module, cache: Any, prompt: torch.Tensor, *, warmup: int = 3) -> HostCalls:
    """The kvzoo functions one steady decode step enters (:func:`steady_step` with a :class:`HostCalls`)."""
    return steady_step(model, cache, prompt, HostCalls(), warmup=warmup)
