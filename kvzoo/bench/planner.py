"""The leaderboard's plan: a :class:`Grid` (what to run) becomes trials (:class:`Trial`), each (model, task, question
position) led by its ``full`` reference, grouped for the executors; :data:`PRESETS` are ``--preset``'s grids.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvzoo.bench.executors import TrialGroup
from kvzoo.bench.report import REFERENCE_POLICY
from kvzoo.bench.tasks import TaskSpec

if TYPE_CHECKING:
    from kvzoo.framework.policy import Policy

# This module imports neither torch nor transformers (the `kvzoo` command builds its --help from it): the dtypes are
# names (torch's attribute names), the question positions are kvzoo.pipeline's, checked when a grid is made.


def registered_variants() -> tuple[str, ...]:
    """Configured variants the leaderboard runs beside every registered policy: each retriever-holding policy's retriever
    class's ``variants`` (``quest(gqa=group)``, ...), so a plugin's join with no code change."""
    from kvzoo import registry

    variants = []
    for name in registry.available():
        retriever = next((f.default for f in dataclasses.fields(registry.policy_class(name)) if f.name == "retriever"),
                         None)
        if isinstance(retriever, str) and retriever in registry.retrievers():
            variants += [f"{name}({v})" for v in registry.retriever_class(retriever).variants]
    return tuple(variants)


@dataclass
class Grid:
    """What to run: ``policies=None`` is every registered policy at run time plus ``variants`` (default
    :func:`registered_variants`); ``max_new_tokens=None`` each task's own; ``audit=True`` counts bound violations
    (slow); ``one_forward=True`` also fills the ``*_one_forward`` fields (not part of a trial's key: a grid asking for
    it runs again the ok trials whose rows lack them).
    """

    models: Sequence[str] = ("smollm2-135m",)
    policies: Sequence[str] | None = None
    ratios: Sequence[float] = (4.0, 8.0)
    tasks: Sequence[TaskSpec] = (TaskSpec(),)
    positions: Sequence[str] = ("after",)
    max_new_tokens: int | None = None
    chunk_size: int | None = None
    continuation_tokens: int = 64
    audit: bool = False
    dtype: str = "float32"
    # configured variants run beside every registered policy when ``policies`` is None (None: the registered ones)
    variants: Sequence[str] | None = None
    one_forward: bool = False

    def __post_init__(self) -> None:
        from kvzoo.pipeline import QUESTION_POSITIONS

        for position in self.positions:
            if position not in QUESTION_POSITIONS:
                raise ValueError(f"question position {position!r} is not one of {QUESTION_POSITIONS}")
        for ratio in self.ratios:
            if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 1 <= ratio < float("inf"):
                raise ValueError(f"ratios must be numbers >= 1 (keep 1/ratio of the rows), got {ratio!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if not self.models or not self.tasks or not self.positions:
            raise ValueError("a grid needs at least one model, one task and one question position")
        if self.policies is not None and (isinstance(self.policies, str) or not self.policies):
            raise ValueError(f"policies must be None (every registered policy) or a non-empty list of policy names, "
                             f"got {self.policies!r}")
        for name, value in (("max_new_tokens", self.max_new_tokens), ("chunk_size", self.chunk_size)):
            if value is not None and not _is_int(value, 1):
                raise ValueError(f"{name} must be None (the default) or an int >= 1, got {value!r}")
        if not _is_int(self.continuation_tokens, 0):
            raise ValueError("continuation_tokens must be an int >= 0 (0: no held-out continuation, no ΔCE), "
                             f"got {self.continuation_tokens!r}")
        if self.variants is not None and (isinstance(self.variants, str)
                                          or not all(isinstance(v, str) for v in self.variants)):
            raise ValueError(f"variants must be a list of policy specs such as 'quest(gqa=group)', got {self.variants!r}")
        if not isinstance(self.one_forward, bool):
            raise ValueError(f"one_forward must be True or False, got {self.one_forward!r}")
        self.ratios = tuple(float(r) for r in self.ratios)

    def settings(self) -> dict[str, Any]:
        """The run settings that change results (in every row, part of each trial's key); ``teacher_forcing`` keeps rows of
        the older one-forward measure from counting as finished trials of this one."""
        return {"max_new_tokens": self.max_new_tokens, "chunk_size": self.chunk_size,
                "continuation_tokens": self.continuation_tokens, "audit": self.audit, "dtype": self.dtype,
                "teacher_forcing": TEACHER_FORCING}


DTYPES = ("float32", "bfloat16", "float16")  # model dtypes a grid may ask for: torch.<name>
# The answer's NLL and the continuation's CE are teacher-forced one decode step per token (what greedy decoding
# runs: a retriever's per-step rule is what they see); the one-forward figures (*_one_forward) are measured beside
# them only when a grid asks (Grid.one_forward, `kvzoo leaderboard --one-forward`)
TEACHER_FORCING = "decode"


def _is_int(value: Any, low: int) -> bool:
    """``value`` is an int (not a bool) >= ``low``."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def needle_grid(
    *,
    models: Sequence[str] = ("smollm2-135m",),
    tasks: Sequence[str] = ("niah_single",),
    haystacks: Sequence[str | None] = (None,),
    context_tokens: Sequence[int] = (2000,),
    depths: Sequence[float] = (0.5,),
    seeds: Sequence[int] = (0,),
    **grid: Any,
) -> Grid:
    """A :class:`Grid` over the product of task names, haystacks, lengths, depths and seeds (cwe: one depth)."""
    specs: list[TaskSpec] = []
    for task, haystack, n, depth, seed in itertools.product(tasks, haystacks, context_tokens, depths, seeds):
        spec = TaskSpec(task=task, context_tokens=n, depth=depth, seed=seed, haystack=haystack)
        if spec not in specs:
            specs.append(spec)
    return Grid(models=tuple(models), tasks=tuple(specs), **grid)


def _leaderboard_tasks() -> tuple[TaskSpec, ...]:
    """The ``leaderboard`` preset's tasks: every RULER task at 2k tokens, the single needle also at 1k, at three depths
    and on every haystack."""
    return (
        *(TaskSpec("niah_single", n, d, 0, "essay") for n in (1000, 2000) for d in (0.1, 0.5, 0.9)),
        TaskSpec("niah_single", 2000, 0.5, 0, "noise"),
        TaskSpec("niah_single", 2000, 0.5, 0, "book"),
        TaskSpec("niah_multikey", 2000, 0.5, 0),
        TaskSpec("niah_multivalue", 2000, 0.5, 0),
        TaskSpec("niah_multiquery", 2000, 0.5, 0),
        TaskSpec("vt", 2000, 0.5, 0),
        TaskSpec("cwe", 2000, None, 0),
    )


def _long_tasks() -> tuple[TaskSpec, ...]:
    """The ``long`` preset's tasks, on Paul Graham's essays: the single needle at 8k, 16k and 32k tokens (five depths x
    two seeds: 10 trials per length), and the multi-key and multi-turn needles at 16k (two depths each)."""
    return (
        *(TaskSpec("niah_single", n, d, s, "paul_graham") for n in (8000, 16000, 32000)
          for d in (0.1, 0.3, 0.5, 0.7, 0.9) for s in (0, 1)),
        *(TaskSpec(task, 16000, d, 0, "paul_graham") for task in ("niah_multikey", "niah_multiturn") for d in (0.3, 0.7)),
    )


PRESETS: dict[str, Callable[[], Grid]] = {
    # `make demo`, the main job, in minutes on 2 CPU cores: every registered policy at 4x and 8x on one needle in 2k
    # tokens of essay text at 2 depths, question after compression -- which policy keeps the needle at which ratio
    # (score, intact rate) and what it reads (KV bytes per token). No held-out continuation (ΔCE: `make leaderboard`):
    # its decode steps were half a trial's time.
    "demo": lambda: needle_grid(depths=(0.25, 0.75), ratios=(4, 8), positions=("after",),
                                continuation_tokens=0, variants=()),
    # `make leaderboard`: every RULER task at 2k tokens, the single needle also at 1k and on every haystack,
    # ratios 2-8, question after and before compression (650 trials; with the decode-mode ΔCE about 1.5 hours on 2
    # one-thread Ray workers by kvzoo.bench.estimate, nearer 3 in one process: docs/scaling.md)
    "leaderboard": lambda: Grid(
        tasks=_leaderboard_tasks(),
        ratios=(2, 4, 8),
        positions=("after", "before"),
        continuation_tokens=32,
    ),
    # the leaderboard's tasks, positions and ΔCE at 4x and 8x, without the two Quest variants (338 trials): 33
    # minutes measured on 2 one-thread workers on 2 cores (`--executor ray --workers 2`; the estimate the grid prints
    # before it starts says 45: docs/scaling.md)
    "leaderboard-hour": lambda: Grid(
        tasks=_leaderboard_tasks(),
        ratios=(4, 8),
        positions=("after", "before"),
        continuation_tokens=32,
        variants=(),
    ),
    # evidence where users decide: Gemma-3-270M (hybrid sliding/global, 32k positions) on real essays at 8k-32k, every
    # policy at 8x and 32x and VestigeKV also at 64x and 128x, question after compression, ΔCE on 32 held-out tokens;
    # the policies that compress at the context's end continue one shared prefill per task
    "long": lambda: Grid(
        models=("gemma3-270m",),
        tasks=_long_tasks(),
        ratios=(8, 32),
        positions=("after",),
        continuation_tokens=32,
        variants=("vestige(ratio=64)", "vestige(ratio=128)"),
    ),
    # the test suite's: a tiny random Llama, two short needle contexts
    "tiny": lambda: needle_grid(
        models=("tiny-llama",), context_tokens=(256,), depths=(0.5,), ratios=(2,), positions=("after", "before"),
    ),
}


@dataclass(frozen=True)
class Trial:
    model: str
    task: TaskSpec
    policy: str
    ratio: float | None
    position: str
    settings: tuple[tuple[str, Any], ...] = ()

    @property
    def key(self) -> str:
        ratio = "-" if self.ratio is None else f"{self.ratio:g}"
        settings = ",".join(f"{k}={v}" for k, v in self.settings)
        return f"{self.model}|{self.task.key}|{self.policy}|{ratio}|{self.position}|{settings}"

    @property
    def label(self) -> str:
        ratio = "" if self.ratio is None else f" {self.ratio:g}x"
        return f"{self.policy}{ratio} {self.task.task} d={self.task.depth} q-{self.position}"

    def reference(self) -> Trial:
        """The full-cache trial this one is compared with."""
        return dataclasses.replace(self, policy=REFERENCE_POLICY, ratio=None)


def needs_ratio(name: str) -> bool:
    """Whether policy ``name`` (a name or a spec) takes the grid's ratios: not for a policy without a budget, nor for a
    spec that fixes its own (``snapkv(budget=128)``), which runs once per task at that size."""
    from kvzoo import registry

    base, params = registry.parse_spec(name)
    if "budget" in params or "ratio" in params:
        return False
    return bool(getattr(registry.policy_class(base), "requires_budget", True))


def plan(grid: Grid) -> list[Trial]:
    """Every trial of ``grid``, reference first for each (model, task, position)."""
    from kvzoo import registry

    available = list(registry.available())
    if grid.policies is not None:
        names = list(grid.policies)
    else:
        variants = registered_variants() if grid.variants is None else grid.variants
        names = available + [v for v in variants if registry.parse_spec(v)[0] in available]
    unknown, unavailable = [], []
    for n in names:
        name = registry.parse_spec(n)[0]
        if name in available:
            continue
        if ":" not in name:
            unknown.append(n)
            continue
        try:  # a namespaced name (kvpress:KnormPress) resolves on demand
            registry.policy_class(name)
        except KeyError as err:  # the message names the namespace's problem (kvpress missing: how to install it)
            unavailable.append(str(err))
    if unknown or unavailable:
        message = f"unknown policies {', '.join(map(repr, unknown))}; registered policies: {', '.join(available)}"
        raise ValueError("; ".join(([message] if unknown else []) + unavailable))
    if grid.policies is not None:
        refused = [(name, why) for name in dict.fromkeys(names) if (why := _builds_nowhere(name, grid.ratios))]
        if refused:
            raise PolicyRefused(refused)
    from kvzoo.model_names import check_model_name

    for model in grid.models:
        check_model_name(model)
    settings = tuple(grid.settings().items())
    trials: dict[str, Trial] = {}  # by key: a policy or ratio named twice is one trial
    for model, spec, position in itertools.product(grid.models, grid.tasks, grid.positions):
        reference = Trial(model, spec, REFERENCE_POLICY, None, position, settings)
        trials.setdefault(reference.key, reference)
        for name in names:
            if name == REFERENCE_POLICY:
                continue
            for ratio in grid.ratios if needs_ratio(name) else (None,):
                trial = Trial(model, spec, name, ratio, position, settings)
                trials.setdefault(trial.key, trial)
    return list(trials.values())


class PolicyRefused(ValueError):
    """Policies a grid names that build at none of its ratios (a misspelt parameter, a value no ratio makes valid):
    each would only be recorded as skipped, so the grid is refused before anything runs. ``refused``: (spec, why)."""

    def __init__(self, refused: list[tuple[str, str]]) -> None:
        self.refused = refused
        super().__init__("; ".join(f"policy {spec!r} builds at none of the grid's ratios: {why}" for spec, why in refused)
                         + ". A policy the grid names must build at one of its ratios at least (one refused at some "
                         "ratios only is recorded as skipped at those)")


def _builds_nowhere(name: str, ratios: Sequence[float]) -> str | None:
    """Why policy spec ``name`` builds at none of ``ratios`` (at no ratio, for a policy without a budget), in the
    words of the first refusal; None when it builds at one at least."""
    first = None
    for ratio in ratios if needs_ratio(name) else (None,):
        try:
            build_policy(name, ratio)
        except (KeyError, TypeError, ValueError) as err:  # what a trial records as skipped
            first = first or f"{type(err).__name__}: {err.args[0] if err.args else err}"
        else:
            return None
    return first


def group_trials(trials: Sequence[Trial]) -> list[TrialGroup]:
    """``trials`` (in plan order) grouped by model, task and question position: the trials that share a
    model, a task and a reference row. A group's reference trial, when pending, comes first."""
    groups: dict[str, TrialGroup] = {}
    for trial in trials:
        key = trial.reference().key
        if key not in groups:
            groups[key] = TrialGroup(key, trial.model, [], first_is_reference=trial.key == key)
        groups[key].trials.append(trial)
    return list(groups.values())


def build_policy(name: str, ratio: float | None) -> Policy:
    """``registry.get_spec(name)`` or ``registry.get_spec(name, ratio=ratio)`` (``name`` may carry parameters)."""
    from kvzoo import registry

    return registry.get_spec(name) if ratio is None else registry.get_spec(name, ratio=ratio)


def trial_row(trial: Trial, status: str = "ok", error: str | None = None) -> dict[str, Any]:
    """The fields of ``trial``'s row that say which trial it is (and its status)."""
    return {
        "key": trial.key,
        "status": status,
        "error": error,
        "model": trial.model,
        **trial.task.as_dict(),
        "policy": trial.policy,
        "ratio": trial.ratio,
        "question_position": trial.position,
    }

