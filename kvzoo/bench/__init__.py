"""kvzoo's benchmark harness: RULER-style tasks, the metrics, the leaderboard runner, tables and plots.

    from kvzoo.bench import Grid, TaskSpec, run_grid, render
    rows = run_grid(Grid(models=["smollm2-135m"], tasks=[TaskSpec("niah_single", 2000, 0.5)]), "results/my.jsonl")
    print(render(rows))

Modules: ``tasks`` (the six RULER tasks, sized in tokens),
``metrics`` (one function per metric), ``runner`` (trials, the grid, the resumable JSONL file),
``executors`` (where trials run: in this process, or ``ray_executor`` on a Ray cluster),
``report`` (markdown tables), ``plots`` (PNG heatmap and curves). ``benchmarks/README.md``
documents the results format and the tables. The haystack text the tasks hide needles in is
:mod:`kvzoo.haystacks` (shared with the reference twins, below both).
"""

from kvzoo.bench.report import detail_table, leaderboard_table, render
from kvzoo.bench.runner import PRESETS, Grid, needle_grid, read_results, run_grid, run_trial
from kvzoo.bench.tasks import TASKS, ByteTokenizer, Task, TaskSpec, make_task

__all__ = [
    "PRESETS", "TASKS", "ByteTokenizer", "Grid", "Task", "TaskSpec", "detail_table", "leaderboard_table",
    "make_task", "needle_grid", "read_results", "render", "run_grid", "run_trial",
]
