"""CUDA graphs of the decode step: ``TieredCache(model, policy, capacity=N, cuda_graph=True)``.

With a fixed capacity a decode step between two events launches the same kernels on the same shapes and storage
(``tests/test_static_step.py``), so :class:`DecodeGraph` captures it once and replays it, as vLLM and gpt-fast do.
The model's forward is wrapped; a step is *steady* when the runtime, from the host's counters, says no layer will
run an event or grow (:func:`next_step_kind`, :func:`steady_run`). An unsteady step runs eagerly, the first steady
step after it warms up, the second is captured and later ones replay with the token id and position copied in.
What a steady step does to the host's counters is recorded at capture (:class:`HostNumbers`) and applied for all
the replays at once when something next reads them (:meth:`DecodeGraph.settle`). Attention masks are not
replayed: a graphed step's token is real. Off by default; not yet run on a GPU (tested on CPU with a stand-in
graph; docs/runtime-and-kernels.md).
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable
from typing import Any

import torch

Number = int | float | bool


def check_cuda_graph(model: torch.nn.Module, capacity: int | None) -> None:
    """ValueError unless a CUDA graph can hold ``model``'s decode steps: CUDA, and a fixed ``capacity``."""
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    if device.type != "cuda" or not torch.cuda.is_available():
        raise ValueError(f"cuda_graph=True captures decode steps in a CUDA graph, which needs CUDA: the model is on "
                         f"{device}. Use cuda_graph=False (the default) off a GPU")
    if capacity is None:
        raise ValueError("cuda_graph=True needs capacity=N (the most tokens the sequence will hold): a captured "
                         "step replays on buffers preallocated for N rows")


class HostNumbers:
    """The Python numbers an object graph holds (ints, floats, bools in attributes, dicts and lists), by path.

    A replayed step does the device's work only, so its host effects are extrapolated from the two steady steps
    before the capture: in a steady run each number is at most quadratic in the step count (a running sum of a
    figure that grows by a fixed amount), so a delta growing by a fixed second difference is exact. A step's own
    figures (:data:`PER_STEP`: the latest forward's reads) are linear in it, from the two steady steps alone: the
    snapshot before the first holds the event's figures. Bools take their value after the capture; tensors are left
    out (the graph updates them)."""

    # the objects walked into: kvzoo's (layers, their states and stores, row buffers, indexes) and transformers'
    # cache layers (Kimi's KDA layers count their tokens on the host too)
    MODULES: tuple[str, ...] = ("kvzoo.", "transformers.cache_utils")
    # attributes holding the latest step's own figures, overwritten each step rather than summed: linear in a steady
    # run, extrapolated from the two steps of it (the number before the first may be an event's, off that line)
    PER_STEP: frozenset[str] = frozenset({"last_read"})

    @classmethod
    def snapshot(cls, root: Any) -> dict[tuple, Number]:
        out: dict[tuple, Number] = {}
        cls._walk(root, (), out, set())
        return out

    @classmethod
    def _walk(cls, obj: Any, path: tuple, out: dict, seen: set) -> None:
        if isinstance(obj, bool | int | float):
            out[path] = obj
            return
        if id(obj) in seen:
            return
        if isinstance(obj, dict):
            seen.add(id(obj))
            for key, value in obj.items():
                if isinstance(key, str | int):
                    cls._walk(value, (*path, ("key", key)), out, seen)
        elif isinstance(obj, list):
            seen.add(id(obj))
            for i, value in enumerate(obj):
                cls._walk(value, (*path, ("item", i)), out, seen)
        elif type(obj).__module__.startswith(cls.MODULES) and hasattr(obj, "__dict__") \
                and not isinstance(obj, torch.nn.Module) \
                and not (dataclasses.is_dataclass(obj) and obj.__dataclass_params__.frozen):  # configuration
            seen.add(id(obj))
            for name, value in vars(obj).items():
                cls._walk(value, (*path, ("attr", name)), out, seen)

    @staticmethod
    def _get(root: Any, path: tuple) -> Number:
        target = root
        for kind, key in path:
            target = target[key] if kind in ("key", "item") else getattr(target, key)
        return target

    @staticmethod
    def _set(root: Any, path: tuple, value: Number) -> None:
        target = root
        for kind, key in path[:-1]:
            target = target[key] if kind in ("key", "item") else getattr(target, key)
        kind, key = path[-1]
        if kind in ("key", "item"):
            target[key] = value
        else:
            setattr(target, key, value)


@dataclasses.dataclass
class _Steps:
    """Host numbers around two consecutive steady steps: before the first, between, after the second."""

    first: dict[tuple, Number]
    second: dict[tuple, Number]
    third: dict[tuple, Number]
    replays: int = 0

    def __post_init__(self) -> None:
        # the numbers a steady step changes, with their first and second differences (the others stay put)
        self.changes = []
        for path, value in self.third.items():
            if isinstance(value, bool):
                if self.second.get(path) != value:
                    self.changes.append((path, value, 0, 0))
                continue
            d1 = self.second.get(path, 0) - self.first.get(path, 0)
            d2 = value - self.second.get(path, 0)
            if any(kind == "attr" and key in HostNumbers.PER_STEP for kind, key in path):
                d1 = d2  # a step's own figure: no second difference (class docstring)
            if d1 or d2:
                self.changes.append((path, None, d2, d2 - d1))

    def advance(self, root: Any, count: int = 1) -> None:
        """``count`` more replayed steps' host effects (:class:`HostNumbers`): the i-th replay since the capture adds
        ``d2 + i (d2 - d1)`` to a number, so ``count`` of them add their sum, in one pass over the numbers a steady
        step changes."""
        done = self.replays
        self.replays += count
        total_i = count * done + count * (count + 1) // 2  # the sum of i over the replays applied now
        for path, value, d2, dd in self.changes:
            if value is not None:  # a flag: its value after a steady step
                HostNumbers._set(root, path, value)
            else:
                HostNumbers._set(root, path, HostNumbers._get(root, path) + count * d2 + dd * total_i)


class CUDAStreamAndPool:
    """What every graph of one :class:`DecodeGraph` shares: the side stream its warm-up steps and captures run on
    (PyTorch's documented recipe) and one memory pool (a new capture after an event reuses the last one's memory)."""

    def __init__(self) -> None:
        self.stream = torch.cuda.Stream()
        self.pool = torch.cuda.graph_pool_handle()


class CUDAGraphRunner:
    """What :class:`DecodeGraph` needs of a graph: warm a function up, capture it once, replay it
    (``torch.cuda.CUDAGraph``), on the stream and memory pool its :class:`DecodeGraph` shares (``shared``)."""

    def __init__(self, shared: CUDAStreamAndPool | None = None) -> None:
        shared = shared or CUDAStreamAndPool()
        self.graph = torch.cuda.CUDAGraph()
        self.pool = shared.pool
        self.stream = shared.stream

    def warm(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` eagerly on the stream the capture will use (its lazy initialisations happen there)."""
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            out = fn()
        torch.cuda.current_stream().wait_stream(self.stream)
        return out

    def capture(self, fn: Callable[[], Any]) -> Any:
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.graph(self.graph, pool=self.pool, stream=self.stream):
            out = fn()
        torch.cuda.current_stream().wait_stream(self.stream)
        return out

    def replay(self) -> None:
        self.graph.replay()


@dataclasses.dataclass
class _Captured:
    runner: Any
    kind: tuple
    steps: _Steps
    output: Any


def next_step_kind(cache: Any) -> tuple[tuple[str, bool], ...] | None:
    """What the next decode step does in each of ``cache``'s tiered layers, as the runtime states it
    (:meth:`~kvzoo.framework.runtime.Runtime.next_step`, host counters only), and whether it retrieves; None when
    any layer will run an event."""
    kinds = []
    for layer in cache.tiered_layers:
        kind = cache.runtime.next_step(layer)
        if kind == "event":
            return None
        kinds.append((kind, layer.store.archive.index is not None and layer.store.archive.positions.n > 0))
    return tuple(kinds)


def steady_run(cache: Any, limit: int) -> int:
    """How many decode steps from the next one on are of its kind in every tiered layer, at most ``limit``
    (:meth:`~kvzoo.framework.runtime.Runtime.run_of`; 0: the next is an event)."""
    return min((cache.runtime.run_of(layer, limit) for layer in cache.tiered_layers), default=0)


# How many steps ahead the runtime is asked whether they will all be of the captured kind (the replays allowed before
# it is asked again).
RUN_LIMIT = 256


class DecodeGraph:
    """Captures a cache's steady decode steps in a CUDA graph and replays them (module docstring)."""

    def __init__(self, model: torch.nn.Module, cache: Any, make_runner: Callable[[], Any] | None = None) -> None:
        # the cache by weak reference: the model's table of graphed caches (install) must not keep a cache alive
        self.model, self._cache = model, weakref.ref(cache)
        if make_runner is None:  # CUDA: one stream and one memory pool for every capture of this cache
            shared = CUDAStreamAndPool()
            make_runner = lambda: CUDAGraphRunner(shared)  # noqa: E731
        self.make_runner = make_runner
        self.captured: _Captured | None = None
        self.warm: tuple | None = None  # (kind, shape, numbers before, after, runner) of the eager steady step just run
        self.ids: torch.Tensor | None = None  # static inputs [B, 1]
        self.positions: torch.Tensor | None = None
        self.captures = self.replays = 0
        self.pending = 0  # replays whose host effects are not applied yet (settle())
        self.left = 0  # replays the runtime allowed before it must be asked again

    @property
    def cache(self) -> Any:
        return self._cache()

    def host_state(self) -> list:
        """What holds the host's numbers of a step: the cache's layers (kvzoo's and the others, e.g. KDA)."""
        return list(self.cache.layers)

    def settle(self) -> None:
        """Apply the host effects of the replays not applied yet (before anything reads the layers' counters)."""
        if self.pending and self.captured is not None:
            self.captured.steps.advance(self.host_state(), self.pending)
        self.pending = 0

    # --- the forward -------------------------------------------------------------------------------------
    def forward(self, call: Callable[..., Any], input_ids: torch.Tensor, position_ids: torch.Tensor | None,
                **kwargs: Any) -> Any:
        """One decode step: replayed, captured, or eager (``call`` is the model's own forward)."""
        if position_ids is None:
            position_ids = torch.full_like(input_ids, self.cache.get_seq_length())
        if self.captured is not None and self.left > 0 and self.ids.shape == input_ids.shape:
            self.left -= 1  # the runtime said so at the last ask: no layer is asked again (O(1) in the layers)
            return self._replay(input_ids, position_ids)
        self.settle()
        kind = next_step_kind(self.cache)
        if kind is not None and self.captured is not None and self.captured.kind == kind \
                and self.ids.shape == input_ids.shape:
            self.left = steady_run(self.cache, RUN_LIMIT) - 1
            return self._replay(input_ids, position_ids)
        self.captured = None
        shape = tuple(input_ids.shape)
        if kind is not None and self.warm is not None and self.warm[:2] == (kind, shape):
            return self._capture(call, kind, input_ids, position_ids, kwargs)
        # an event, or the first steady step after one: eager (it warms the new shapes up on the capture's stream,
        # and gives the host numbers' first steady delta)
        layers = self.host_state()
        if kind is None:
            self.warm = None
            return call(input_ids=input_ids, position_ids=position_ids, **kwargs)
        runner = self.make_runner()
        before = HostNumbers.snapshot(layers)
        warm = getattr(runner, "warm", None)
        step = lambda: call(input_ids=input_ids, position_ids=position_ids, **kwargs)  # noqa: E731
        out = warm(step) if warm is not None else step()
        self.warm = (kind, shape, before, HostNumbers.snapshot(layers), runner)
        return out

    def _replay(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> Any:
        self.ids.copy_(input_ids)
        self.positions.copy_(position_ids)
        self.captured.runner.replay()
        self.pending += 1
        self.replays += 1
        return self._output()

    def _output(self) -> Any:
        """The captured output with its logits copied out (the graph overwrites them at the next replay)."""
        out = self.captured.output
        return type(out)(**{**out, "logits": out["logits"].clone()})

    def _capture(self, call, kind, input_ids, position_ids, kwargs) -> Any:
        self.ids, self.positions = input_ids.clone(), position_ids.clone()
        kwargs = {k: v for k, v in kwargs.items() if k != "attention_mask"}  # a graphed token is a real token
        _, _, first, second, runner = self.warm
        left = steady_run(self.cache, RUN_LIMIT) - 1  # asked before the capture: the captured step is the first of the run
        output = runner.capture(lambda: call(input_ids=self.ids, position_ids=self.positions, **kwargs))
        third = HostNumbers.snapshot(self.host_state())
        runner.replay()  # capturing records the kernels; this runs them for the step being captured
        self.captured = _Captured(runner, kind, _Steps(first, second, third), output)
        self.left = left
        self.warm = None
        self.captures += 1
        return self._output()


def install(model: torch.nn.Module, cache: Any, make_runner: Callable[[], Any] | None = None) -> DecodeGraph:
    """Route ``model``'s single-token forwards with ``cache`` through a :class:`DecodeGraph` (idempotent per
    model: the wrapper dispatches on the cache it is handed, so several graphed caches can share a model)."""
    graph = DecodeGraph(model, cache, make_runner)
    graphs = getattr(model, "_kvzoo_graphs", None)
    if graphs is None:
        graphs = model._kvzoo_graphs = weakref.WeakKeyDictionary()
        original = model.forward

        def forward(*args: Any, **kwargs: Any) -> Any:
            cache_arg = kwargs.get("cache", kwargs.get("past_key_values"))
            ids = kwargs.get("input_ids", args[0] if args else None)
            graphed = graphs.get(cache_arg) if cache_arg is not None and not isinstance(cache_arg, bool) else None
            if graphed is None or ids is None or ids.dim() != 2 or ids.shape[1] != 1 or args:
                if graphed is not None:
                    graphed.settle()  # an eager forward reads the counters the replays moved
                return original(*args, **kwargs)
            kwargs.pop("input_ids")
            return graphed.forward(original, ids, kwargs.pop("position_ids", None), **kwargs)

        model._kvzoo_original_model_forward = original
        model.forward = forward
    graphs[cache] = graph
    return graph
