"""Where a leaderboard's trials run: the seam between planning a grid and running its trials.

:func:`kvzoo.bench.runner.run_grid` plans the grid and is the only writer of the results file; an executor
(:class:`LocalExecutor`, or a plugin's such as ``RayExecutor``) runs the :class:`Work` left and calls ``emit(trial,
row, run_info)`` once per trial (:data:`EMIT_CONTRACT`). This module imports nothing else of kvzoo.
"""

from __future__ import annotations

import argparse
import os
import socket
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

Row = dict[str, Any]
Emit = Callable[[Any, Row, dict[str, Any]], None]


@dataclass
class TrialGroup:
    """Pending trials that share a model, a task and a question position, in plan order; with ``first_is_reference``
    the others wait for the first, the ``full`` reference their ΔNLL and ΔCE are measured against."""

    key: str
    model: str
    trials: list[Any]
    first_is_reference: bool = False


@dataclass
class Work:
    """What an executor runs: the pending trials and the driver's side of running them."""

    groups: list[TrialGroup]
    make_runner: Callable[[], Any]  # picklable; in a worker: runner.run(trial, reference) -> row
    reference: Callable[[Any], Any]  # driver side: the reference figures for a trial now (or None)
    failed_row: Callable[[Any, str], Row]  # driver side: the row of a trial no worker could finish
    label: Callable[[Any], str] = str
    on_start: Callable[[Any, str], None] | None = None  # (trial, worker) as a trial is handed out

    @property
    def trial_count(self) -> int:
        return sum(len(g.trials) for g in self.groups)


class Executor(Protocol):
    """Runs :class:`Work`, calling ``emit`` once per trial (from the caller's thread) as each finishes.

    Registered by ``name`` (``--executor NAME``) with a one-line ``summary``; ``add_arguments(group)`` adds its own
    ``kvzoo leaderboard`` options (``default=None``), whose ``dest`` names are its constructor's keywords.
    """

    name: ClassVar[str]
    summary: ClassVar[str]

    @classmethod
    def add_arguments(cls, group: argparse._ArgumentGroup) -> None: ...

    def run(self, work: Work, emit: Emit) -> None: ...


EMIT_CONTRACT = ("an executor calls emit(trial, row, run_info) exactly once for each trial of the Work it was given, "
                 "with that trial's own row (a dict with its key, status, model, policy and task: what "
                 "Work.make_runner()'s run(trial, reference) returns for it) and run_info a dict")


class ExecutorError(RuntimeError):
    """An executor broke :data:`EMIT_CONTRACT` (a row that is not its trial's, a trial returned twice or never) or
    raised. The message names the executor and what it did; the refused row was not written (the rows before it
    were, each checked against its trial), and a rerun resumes with the trials that have no row."""


class ExecutorUnavailable(RuntimeError):
    """An executor cannot run here (a package it needs is missing, its cluster cannot be reached): the message
    says what to do."""


def int_option(subject: str, low: int = 1, note: str = "") -> Callable[[str], int]:
    """An argparse type: an int >= ``low``, or an error saying ``{subject} is an int >= {low}{note}``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = low - 1
        if value < low:
            raise argparse.ArgumentTypeError(f"{subject} is an int >= {low}{note}, got {text!r}")
        return value

    return parse


def float_option(valid: str, ok: Callable[[float], bool]) -> Callable[[str], float]:
    """An argparse type: the float ``text`` holds where ``ok`` accepts it, else an error saying what is ``valid``."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{valid}, got {text!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"{valid}, got {text!r}")
        return value

    return parse


def number_option(option: str, strict: bool = False) -> Callable[[str], float]:
    """An argparse type: a finite number >= 0 (``strict``: > 0), or an error naming ``--{option}``."""
    return float_option(f"--{option} is a number {'> 0' if strict else '>= 0'}",
                        lambda value: (value > 0 if strict else value >= 0) and value != float("inf"))


def worker_name() -> str:
    """This process as the ``worker`` field of a row: ``host:pid``."""
    return f"{socket.gethostname()}:{os.getpid()}"


def timed_run(runner: Any, trial: Any, reference: Any) -> tuple[Row, dict[str, Any]]:
    """``runner.run(trial, reference)`` and the run info a worker adds: ``worker``, ``trial_seconds`` and
    ``model_load_s``, the part of it spent loading a model first (not the trial's cost, so not counted in it)."""
    loaded_before = getattr(runner, "load_seconds", 0.0)
    started = time.perf_counter()
    row = runner.run(trial, reference)
    elapsed = time.perf_counter() - started
    loading = getattr(runner, "load_seconds", 0.0) - loaded_before
    return row, {"worker": worker_name(), "trial_seconds": elapsed - loading, "model_load_s": loading}


class LocalExecutor:
    """Every trial in this process, one after another in plan order (today's leaderboard loop)."""

    name = "local"
    summary = "every trial in this process (default)"

    @classmethod
    def add_arguments(cls, group: argparse._ArgumentGroup) -> None:
        """No options: the trials run here, one after another."""

    def run(self, work: Work, emit: Emit) -> None:
        runner = work.make_runner()
        for group in work.groups:
            for trial in group.trials:
                if work.on_start is not None:
                    work.on_start(trial, "local")
                row, info = timed_run(runner, trial, work.reference(trial))
                emit(trial, row, {**info, "attempts": 1, "attempt_errors": []})

    def __repr__(self) -> str:
        return "LocalExecutor()"


# --- handing out trials to several workers -------------------------------------------------------------


@dataclass
class _GroupState:
    group: TrialGroup
    left: deque = field(default_factory=deque)
    reference_out: bool = False  # the reference trial is running: the others wait for its row
    reference_done: bool = False

    @property
    def ready(self) -> bool:
        return bool(self.left) and not self.reference_out

    @property
    def started(self) -> bool:  # the reference is known, so any trial left can run anywhere
        return not self.group.first_is_reference or self.reference_done


class TrialQueue:
    """The pending trials of several groups, handed to workers as they become ready: a group's reference first, then its
    other trials on any worker. A worker keeps to its group, then its model (a switch reloads weights), and starts a
    new group before helping with a started one."""

    def __init__(self, groups: Sequence[TrialGroup]) -> None:
        self._groups = [_GroupState(g, deque(g.trials)) for g in groups if g.trials]
        self._by_key = {s.group.key: s for s in self._groups}
        self._order = {s.group.key: i for i, s in enumerate(self._groups)}

    def __len__(self) -> int:
        return sum(len(s.left) for s in self._groups)

    def take(self, group_key: str | None = None, model: str | None = None) -> tuple[TrialGroup, Any] | None:
        """The next trial for a worker last busy with ``group_key`` / ``model``; None when nothing is ready."""
        ready = [s for s in self._groups if s.ready]
        if not ready:
            return None

        def preference(s: _GroupState) -> tuple:
            return (s.group.key != group_key, s.group.model != model, s.started,
                    -len(s.left) if s.started else self._order[s.group.key])

        state = min(ready, key=preference)
        trial = state.left.popleft()
        if state.group.first_is_reference and not state.reference_done:
            state.reference_out = True
        return state.group, trial

    def finished(self, group: TrialGroup, trial: Any) -> None:
        """``trial``'s row is in (whatever its status): a reference releases its group."""
        state = self._by_key[group.key]
        if state.reference_out and trial is group.trials[0]:
            state.reference_out, state.reference_done = False, True

    def retry(self, group: TrialGroup, trial: Any) -> None:
        """``trial`` lost its worker: it goes back to the front of its group."""
        state = self._by_key[group.key]
        state.left.appendleft(trial)
        if state.reference_out and trial is group.trials[0]:
            state.reference_out = False
