"""kvzoo's benchmark harness: RULER-style tasks, the metrics, the leaderboard runner, tables and plots.

    from kvzoo.bench import Grid, TaskSpec, run_grid, render
    rows = run_grid(Grid(models=["smollm2-135m"], tasks=[TaskSpec("niah_single", 2000, 0.5)]), "results/my.jsonl")
    print(render(rows))

The names below are imported on first use (PEP 562): importing ``kvzoo.bench.executors`` or ``kvzoo.bench.tasks``
(the ``kvzoo`` command's ``--help`` and ``list`` do) must not import torch and transformers through this package.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_LAZY = {name: module for module, names in {  # name -> the module it is imported from on first use
    "kvzoo.bench.report": ("detail_table", "leaderboard_table", "render"),
    "kvzoo.bench.planner": ("PRESETS", "Grid", "needle_grid"),
    "kvzoo.bench.results": ("read_results",),
    "kvzoo.bench.runner": ("run_grid",),
    "kvzoo.bench.trial": ("run_trial",),
    "kvzoo.bench.tasks": ("TASKS", "ByteTokenizer", "Task", "TaskSpec", "make_task"),
}.items() for name in names}

__all__ = [  # the names of _LAZY, written out (static analysers read a literal list)
    "PRESETS", "TASKS", "ByteTokenizer", "Grid", "Task", "TaskSpec", "detail_table", "leaderboard_table",
    "make_task", "needle_grid", "read_results", "render", "run_grid", "run_trial",
]

if TYPE_CHECKING:
    from kvzoo.bench.planner import PRESETS, Grid, needle_grid
    from kvzoo.bench.report import detail_table, leaderboard_table, render
    from kvzoo.bench.results import read_results
    from kvzoo.bench.runner import run_grid
    from kvzoo.bench.tasks import TASKS, ByteTokenizer, Task, TaskSpec, make_task
    from kvzoo.bench.trial import run_trial


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'kvzoo.bench' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
