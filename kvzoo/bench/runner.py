"""The leaderboard runner: (model × policy × ratio × task × question before/after) → one JSONL row per trial.

:func:`run_grid` plans a :class:`Grid`, skips the trials whose ``ok`` row is in the results file (unless it records
another configuration than the policy name builds now), hands the rest to an executor grouped by (model, task,
question position) with each group's ``full`` reference first, and is the only writer of the results file. The
planner's, the results file's and the trial's public names are importable from here too.
"""

from __future__ import annotations

import datetime
import functools
import inspect
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kvzoo.bench.executors import (
    EMIT_CONTRACT,
    Executor,
    ExecutorError,
    ExecutorUnavailable,
    LocalExecutor,
    Work,
)
from kvzoo.bench.planner import (  # noqa: F401 - re-exported: the runner's public names
    DTYPES,
    PRESETS,
    Grid,
    PolicyRefused,
    Trial,
    build_policy,
    group_trials,
    needle_grid,
    needs_ratio,
    plan,
    registered_variants,
    trial_row,
)
from kvzoo.bench.report import REFERENCE_POLICY
from kvzoo.bench.results import (  # noqa: F401 - re-exported
    RESULTS_DIR,
    ResultsFile,
    ResultsFileError,
    ResultsFileLocked,
    ResultsWriteError,
    _json_default,
    append_row,
    check_output_dir,
    check_results_path,
    check_results_target,
    latest_rows,
    read_results,
    read_results_file,
    results_lock,
    row_problem,
    versions,
)
from kvzoo.bench.tasks import ByteTokenizer, Task, TaskSpec, fewest_context_tokens, make_task
from kvzoo.bench.trial import (  # noqa: F401 - re-exported
    Reference,
    SharedPrefill,
    add_reference,
    encode_prompt,
    run_trial,
)
from kvzoo.framework.cache import dense_prefill_problem
from kvzoo.framework.names import policy_retriever
from kvzoo.models import check_model_name

# --- models --------------------------------------------------------------------------------------


def load(name: str, dtype: str = "float32") -> tuple[torch.nn.Module, Any]:
    """``(model, tokenizer)`` for the leaderboard (:func:`kvzoo.models.load_model`); a
    :class:`ByteTokenizer` stands in for models without a tokenizer."""
    from kvzoo.models import load_model

    check_model_name(name)
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    model, tokenizer = load_model(name, getattr(torch, dtype))
    loaded = next(model.parameters()).dtype
    if loaded != getattr(torch, dtype):  # the row records the grid's dtype: it must be the one that ran
        raise ValueError(f"model {name!r} loaded as {str(loaded).removeprefix('torch.')}, not the {dtype} asked for")
    if tokenizer is None:
        vocab = getattr(getattr(model, "config", None), "vocab_size", 0)
        if vocab < 256:
            raise ValueError(f"model {name!r} has no tokenizer and a vocabulary of {vocab} < 256 byte ids")
        tokenizer = ByteTokenizer()
    return model, tokenizer


def check_context_fits(limit: int | None, context_tokens: int, model: str) -> None:
    """A ValueError, before a context is built, when one of ``context_tokens`` tokens cannot fit ``limit`` positions
    (model ``model``'s ``max_position_embeddings``; None: it declares none) whatever the trial adds to it."""
    fewest = fewest_context_tokens(context_tokens)
    if limit is not None and fewest > limit:
        raise ValueError(
            f"context_tokens={context_tokens} cannot fit model {model!r}: the context alone holds at least {fewest} "
            f"tokens, more than its max_position_embeddings ({limit}), and positions past {limit} were never trained. "
            f"Give a context of fewer than {limit} tokens (with room for the question and the answer)")


_MAX_POSITIONS: dict[tuple[str, str], int | None] = {}  # kvzoo's named models, read once per process


def model_max_positions(name: str, dtype: str = "float32") -> int | None:
    """Model ``name``'s ``max_position_embeddings`` (None when it declares none or its config cannot be read here): read
    from the config alone, but for kvzoo's named models, which are built (they load in a second)."""
    from kvzoo.models import MODEL_NAMES
    from kvzoo.pipeline import config_max_positions, max_positions

    if name in MODEL_NAMES:
        if (name, dtype) not in _MAX_POSITIONS:
            try:
                _MAX_POSITIONS[name, dtype] = max_positions(load(name, dtype)[0])
            except Exception:  # noqa: BLE001 - it does not load here (weights missing): each trial's row says why
                return None
        return _MAX_POSITIONS[name, dtype]
    try:
        from transformers import AutoConfig

        import kvzoo.refmodel  # noqa: F401  (registers model_type "kvzoo_mla" with the Auto classes)

        config = AutoConfig.from_pretrained(name, local_files_only=Path(name).expanduser().is_dir())
    except Exception:  # noqa: BLE001 - no config to read here (offline, a bad directory): the trial reports it
        return None
    return config_max_positions(config)


def check_grid_positions(grid: Grid) -> None:
    """A ValueError naming the model and the length when a task of ``grid`` cannot fit a model's positions
    (:func:`check_context_fits`): decided from the grid and the models' configs, before any task is built."""
    longest = max(spec.context_tokens for spec in grid.tasks)
    for model in grid.models:
        check_context_fits(model_max_positions(model, grid.dtype), longest, model)


# --- running the pending trials -------------------------------------------------------------------


class TrialRunner:
    """Runs trials in one process, keeping what they share: the loaded model, built tasks. One lives in the driver, one
    in each Ray worker; ``device``: where the model runs (None: where it loads)."""

    def __init__(self, grid: Grid, device: str | None = None, progress: Any = None) -> None:
        self.grid = grid
        self.device = device
        self.progress = progress  # a kvzoo.pipeline.Progress showing each trial's phase (in the driver only)
        self.models: dict[str, tuple[torch.nn.Module, Any]] = {}
        self.tasks: dict[tuple[str, str], Task] = {}
        self.load_seconds = 0.0  # spent loading models so far (the executors keep it out of trial_seconds)
        self.shared = SharedPrefill(record_window=_widest_window(grid))

    def close(self) -> None:
        """Free the kept prefill."""
        self.shared.clear()

    def model(self, name: str) -> tuple[torch.nn.Module, Any]:
        if name not in self.models:
            self.shared.clear()  # a prefill of the previous model
            self.models.clear()  # one model in memory at a time
            if self.progress is not None:
                self.progress.phase(f"loading {name}")
            started = time.perf_counter()
            model, tokenizer = load(name, self.grid.dtype)
            self.models[name] = (model.to(self.device) if self.device else model), tokenizer
            self.load_seconds += time.perf_counter() - started
        return self.models[name]

    def task(self, name: str, spec: TaskSpec) -> Task:
        key = (name, spec.key)
        if key not in self.tasks:
            from kvzoo.pipeline import max_positions

            check_context_fits(max_positions(self.model(name)[0]), spec.context_tokens, name)  # before building it
            self.tasks[key] = make_task(spec, self.model(name)[1], continuation_tokens=self.grid.continuation_tokens)
        return self.tasks[key]

    def run(self, trial: Trial, reference: Reference | None) -> dict[str, Any]:
        """``trial``'s row (status ok, skipped or error), measured against ``reference`` (the full cache's figures)."""
        if self.progress is None:
            return _execute(trial, self, reference)
        from kvzoo import pipeline

        self.progress.relabel(trial.label)
        with pipeline.reporting(self.progress):
            return _execute(trial, self, reference)


def _widest_window(grid: Grid) -> int:
    """The widest observation window among the grid's policies that share a dense prefill (0: none)."""
    from kvzoo import registry

    widest = 0
    for name in grid.policies if grid.policies is not None else registry.available():
        try:
            ratios = grid.ratios if needs_ratio(name) else (None,)
        except Exception:  # noqa: BLE001 - a policy the grid will record as skipped shares nothing
            continue
        for ratio in ratios:
            try:
                policy = build_policy(name, ratio)
            except Exception:  # noqa: BLE001 - as above
                continue
            if dense_prefill_problem(policy, one_forward=1) is None and "window" in policy.observes:
                widest = max(widest, policy.observation_window)
    return widest


def reference_of(latest: dict[str, dict[str, Any]], trial: Trial) -> Reference | None:
    """The reference figures for ``trial`` from the rows so far (None until its reference row is ok)."""
    row = latest.get(trial.reference().key)
    if not row or row.get("status") != "ok":
        return None
    return Reference.of(row)


def _as_json(value: Any) -> Any:
    """``value`` as a results row stores it (:func:`~kvzoo.bench.results.append_row`'s encoding: tuples become
    lists, dtypes their name, other objects their ``repr``)."""
    return json.loads(json.dumps(value, default=_json_default))


def _configuration_now(policy: str, ratio: float | None, built: dict) -> dict[str, Any] | None:
    """The ``policy_config`` and ``retriever_config`` that ``policy`` at ``ratio`` builds now, as a row stores them
    (None when it no longer builds); memoised in ``built``."""
    if (policy, ratio) not in built:
        try:
            made = build_policy(policy, ratio)
        except (KeyError, TypeError, ValueError):
            built[policy, ratio] = None
        else:
            retriever = policy_retriever(made)
            built[policy, ratio] = {"policy_config": _as_json(made.config()),
                                    "retriever_config": None if retriever is None else _as_json(retriever.config())}
    return built[policy, ratio]


def stale_configuration(row: dict[str, Any], built: dict | None = None) -> str | None:
    """What differs between the configuration ``row`` records and the one its policy name builds now (a changed default),
    or None when they agree or it no longer builds. ``built`` memoises what each (policy, ratio) builds."""
    now = _configuration_now(row["policy"], row.get("ratio"), {} if built is None else built)
    if now is None:
        return None
    changed = []
    for field, config in now.items():
        if field in row and config != row[field]:
            old, new = row[field] or {}, config or {}
            keys = sorted(set(old) | set(new), key=str) if isinstance(old, dict) and isinstance(new, dict) else []
            diffs = [f"{k}={old.get(k)!r} (now {new.get(k)!r})" for k in keys if old.get(k) != new.get(k)]
            changed.append(f"{field} {', '.join(diffs) if diffs else repr(row[field])}")
    return "; ".join(changed) or None


def current_rows(rows: list[dict[str, Any]]) -> tuple[dict[str, dict[str, Any]], list[tuple[dict[str, Any], str]]]:
    """:func:`latest_rows` passing over ``ok`` rows of a stale configuration (:func:`stale_configuration`), and those rows
    with what changed: resuming, the table and the plots all read a results file through here, so they agree."""
    built: dict = {}
    stale: list[tuple[dict[str, Any], str]] = []

    def changed(row: dict[str, Any]) -> str | None:
        why = stale_configuration(row, built)
        if why:
            stale.append((row, why))
        return why

    return latest_rows(rows, stale=changed), stale


def _execute(trial: Trial, ctx: TrialRunner, reference: Reference | None) -> dict[str, Any]:
    row = trial_row(trial)
    try:
        policy = build_policy(trial.policy, trial.ratio)
    except (KeyError, TypeError, ValueError) as err:
        row.update(status="skipped", error=f"{type(err).__name__}: {err.args[0] if err.args else err}")
        return row
    row["policy_config"] = policy.config()
    retriever = policy_retriever(policy)
    row["retriever_config"] = None if retriever is None else retriever.config()  # what ran, not the defaults
    try:
        model, tokenizer = ctx.model(trial.model)
        task = ctx.task(trial.model, trial.task)
        row["metric"] = task.metric
        row.update(run_trial(
            model, tokenizer, task, policy,
            position=trial.position,
            reference=reference,
            max_new_tokens=ctx.grid.max_new_tokens,
            chunk_size=ctx.grid.chunk_size,
            audit=ctx.grid.audit,
            shared=ctx.shared,
            shared_key=(trial.model, trial.task.key, trial.position),
            one_forward=ctx.grid.one_forward,
        ))
    except (KeyboardInterrupt, SystemExit):
        raise
    except Exception as err:  # a failing policy must not stop the grid; the row says what happened
        row.update(status="error", error=f"{type(err).__name__}: {err}")
        return row
    if trial.policy == REFERENCE_POLICY and trial.ratio is None:
        add_reference(row, Reference.of(row))
    return row


def make_executor(name: str, **options: Any) -> Executor:
    """The executor registered as ``name`` built from ``options`` (its constructor's keywords, None values left out); a
    ValueError names the valid executors, or the valid options."""
    from kvzoo import registry

    cls = registry.executor_class(name)
    given = {k: v for k, v in options.items() if v is not None}
    params = [p for p in inspect.signature(cls).parameters.values() if p.kind is not p.VAR_POSITIONAL]
    if not any(p.kind is p.VAR_KEYWORD for p in params):
        unknown = sorted(set(given) - {p.name for p in params})
        if unknown and not params:
            raise ValueError(f"the {name} executor takes no options (got {', '.join(unknown)})")
        if unknown:
            raise ValueError(f"the {name} executor takes {', '.join(p.name for p in params)}, not {', '.join(unknown)}")
    return cls(**given)


def run_grid(
    grid: Grid,
    results: str | Path,
    *,
    fresh: bool = False,
    force: bool = False,
    progress: bool = True,
    on_row: Callable[[dict[str, Any]], None] | None = None,
    executor: Executor | None = None,
    estimate: bool = False,
) -> list[dict[str, Any]]:
    """Run every trial of ``grid`` not already finished in ``results`` (:func:`current_rows`); return the grid's rows
    in plan order. ``results`` must be a kvzoo results file or not exist (:func:`check_results_target`: ``force``,
    ``fresh``); it is locked while the grid runs, and each row, checked against its trial (:data:`EMIT_CONTRACT`), is
    appended at once by this process, whichever ``executor`` ran it. ``estimate=True`` prints the estimated time first.
    """
    path = check_results_path(results)
    trials = plan(grid)
    check_grid_positions(grid)
    path.parent.mkdir(parents=True, exist_ok=True)
    with results_lock(path) as locked:
        found = check_results_target(path, force=force, fresh=fresh)  # read under the lock: nobody else appends
        if fresh and found.rows:  # nothing but kvzoo's rows (checked above), started over on request
            os.ftruncate(locked, 0)
            found = ResultsFile(path)
        for problem in found.problems():
            print(f"kvzoo: {problem}", file=sys.stderr)
        latest, stale = current_rows(found.rows)
        planned = {t.key: t for t in trials}
        for row, changed in stale:  # each trial once, and only where no current ok row finished it
            trial = planned.pop(row["key"], None)
            if trial is not None and latest.get(trial.key, {}).get("status") != "ok":
                print(f"kvzoo: {trial.label}: its row ran with {changed}; running it again", file=sys.stderr)
        return _run_pending(grid, trials, path, latest, progress=progress, on_row=on_row,
                            executor=executor if executor is not None else LocalExecutor(), estimate=estimate)


class _Intake:
    """What an executor hands back, matched to the trials it was given before anything is written (:data:`EMIT_CONTRACT`);
    anything else is an :class:`ExecutorError`, kept so an executor that swallows it still fails."""

    def __init__(self, executor: Any, trials: list[Trial], path: Path) -> None:
        cls = type(executor)
        self.who = f"executor {getattr(cls, 'name', cls.__name__)!r} ({cls.__module__}:{cls.__qualname__})"
        self.given = {t.key: t for t in trials}
        self.path = path
        self.returned: set[str] = set()  # the keys whose rows were written
        self.refusal: ExecutorError | None = None

    def _refuse(self, problem: str) -> ExecutorError:
        written = (f"the {len(self.returned)} row(s) it returned before were written to {self.path}, each checked "
                   "against its trial" if self.returned else f"nothing was written to {self.path}")
        refusal = ExecutorError(
            f"{self.who} broke the executor contract: {problem}. The contract: {EMIT_CONTRACT}. That row was not "
            f"written; {written}, and the trials left were not run. Fix the executor; rerunning the same command "
            "resumes with the trials that have no row")
        self.refusal = self.refusal or refusal  # the first one is the one to report
        return refusal

    def accept(self, trial: Any, row: Any, info: Any, extra: dict[str, Any]) -> tuple[Trial, dict[str, Any]]:
        """``(the trial, the row to write)`` for what the executor emitted, or an :class:`ExecutorError`."""
        key = getattr(trial, "key", None)
        mine = self.given.get(key) if isinstance(key, str) else None
        if mine is None:
            label = getattr(trial, "label", None)
            which = f"{label} (trial key {key!r})" if isinstance(label, str) else _short(trial)
            raise self._refuse(f"emit() was called for {which}, which is not one of the {len(self.given)} trials it "
                               "was given")
        if key in self.returned:
            raise self._refuse(f"emit() was called a second time for {mine.label} (trial key {key!r})")
        if not isinstance(row, dict):
            raise self._refuse(f"its row for {mine.label} is a {type(row).__name__} ({_short(row)}), not a dict")
        if not isinstance(info, dict):
            raise self._refuse(f"its run_info for {mine.label} is a {type(info).__name__} ({_short(info)}), not a dict")
        final = {**row, **info, **extra}
        why = row_problem(final)
        if why is not None:
            raise self._refuse(f"its row for {mine.label} is not a kvzoo results row: "
                               f"{why.removeprefix('JSON, but not a kvzoo results row ')}")
        expected = {k: v for k, v in trial_row(mine).items() if k not in ("status", "error")}
        wrong = [k for k, v in expected.items() if _as_json(final.get(k)) != _as_json(v)]
        if wrong:
            said = ", ".join(f"{k}={final.get(k)!r}" for k in wrong)
            raise self._refuse(f"the row it returned for {mine.label} is another trial's ({said}; this trial's: "
                               f"{', '.join(f'{k}={expected[k]!r}' for k in wrong)})")
        self.returned.add(key)
        return mine, final

    def missing(self) -> list[Trial]:
        return [t for t in self.given.values() if t.key not in self.returned]


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


def finished(row: dict[str, Any], grid: Grid) -> bool:
    """Whether ``row`` finished its trial for ``grid``: it is ok and, when the grid asks for the one-forward
    figures (``Grid.one_forward``), holds them (a row of a grid without them is run again)."""
    if row.get("status") != "ok":
        return False
    return not grid.one_forward or row.get("answer_nll_one_forward") is not None


def _run_pending(grid: Grid, trials: list[Trial], path: Path, latest: dict[str, dict[str, Any]], *, progress: bool,
                 on_row: Callable[[dict[str, Any]], None] | None, executor: Executor,
                 estimate: bool = False) -> list[dict[str, Any]]:
    """:func:`run_grid`'s loop: the trials of ``trials`` not finished in ``latest`` (the file's current rows), each
    new row checked against its trial (:class:`_Intake`) and appended to ``path``."""
    done = {t.key for t in trials if finished(latest.get(t.key, {}), grid)}
    run_info = {"settings": grid.settings(), "versions": versions()}
    pending = [t for t in trials if t.key not in done]
    if done:  # a rerun keeps the finished trials: say so, and how to start over
        print(f"kvzoo: resuming: {len(done)} of {len(trials)} trials finished in {path} are kept, {len(pending)} to run "
              "(--fresh starts over)", file=sys.stderr)
    intake = _Intake(executor, pending, path)
    if estimate and pending:
        from kvzoo.bench import estimate as cost_model

        workers = 1 if isinstance(executor, LocalExecutor) else getattr(executor, "workers", None)
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            workers = None  # an executor that does not say (a plugin's, Ray's "as many as the cluster holds")
        print(cost_model.describe(cost_model.estimate(pending, grid), workers), file=sys.stderr)

    from tqdm.auto import tqdm

    bar = tqdm(
        total=len(trials), initial=len(done), desc="kvzoo leaderboard", unit="trial",
        disable=not progress, file=sys.stderr, dynamic_ncols=True,
    )
    running: dict[str, str] = {}  # trial key -> label, while a worker has it
    # each trial's phase (prefill chunk k/n, compress, decode t/T, ...) on a second bar, when the trials run in this
    # process (a Ray worker's phases stay in the worker): a long prefill no longer looks like a hang
    phases = None
    if progress and isinstance(executor, LocalExecutor):
        from kvzoo import pipeline

        phases = pipeline.Progress(position=1, leave=False)

    def started(trial: Trial, worker: str) -> None:
        label = getattr(trial, "label", None)
        if not isinstance(label, str):  # not a trial: emit() will refuse it
            return
        running[getattr(trial, "key", label)] = label
        shown = label if len(running) == 1 else f"{len(running)} running: {label}, ..."
        bar.set_postfix_str(shown, refresh=True)

    write_failure: list[BaseException] = []  # this side's own failure inside emit (a full disk), not the executor's

    def emit(trial: Trial, row: dict[str, Any], info: dict[str, Any]) -> None:
        now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        trial, row = intake.accept(trial, row, info, {**run_info, "finished_at": now})
        running.pop(trial.key, None)
        try:
            append_row(path, row)
        except BaseException as err:
            write_failure.append(err)
            raise
        latest[trial.key] = row  # a pending trial has no ok row to keep
        if row["status"] != "ok":
            bar.write(f"{trial.label}: {row['status']}: {row.get('error')}", file=sys.stderr)
        bar.update(1)
        if on_row is not None:
            on_row(row)

    work = Work(
        groups=group_trials(pending),
        make_runner=functools.partial(TrialRunner, grid, progress=phases),
        reference=functools.partial(reference_of, latest),
        failed_row=lambda trial, cause: trial_row(trial, "error", cause),
        label=lambda trial: trial.label,
        on_start=started,
    )
    try:
        executor.run(work, emit)
    except ExecutorUnavailable:
        raise
    except Exception as err:
        if write_failure:  # the results file failed under the executor: that is the error, whatever it made of it
            raise write_failure[0] from None
        if intake.refusal is not None:
            raise intake.refusal from None
        where = f"after returning {len(intake.returned)} of the {len(pending)} trials' rows (written to {path}, each " \
                "checked against its trial)" if intake.returned else f"before returning any row (nothing was written to {path})"
        raise ExecutorError(f"{intake.who} raised {type(err).__name__}: {err} {where}; the trials left were not run. "
                            "Fix the executor (or run with another --executor); rerunning the same command resumes "
                            "with the trials that have no row") from err
    finally:
        if phases is not None:
            phases.close()
        bar.close()
    if write_failure:
        raise write_failure[0]
    if intake.refusal is not None:  # refused, and the executor swallowed the refusal
        raise intake.refusal
    missing = intake.missing()
    if missing:
        shown = ", ".join(t.label for t in missing[:5]) + (", ..." if len(missing) > 5 else "")
        raise ExecutorError(
            f"{intake.who} returned no row for {len(missing)} of the {len(pending)} trials it was given ({shown}): "
            f"they were not run, and nothing was written for them. The contract: {EMIT_CONTRACT}. "
            f"{len(intake.returned)} row(s) were written to {path}; rerunning the same command resumes with the "
            "trials that have no row")
    return [latest[t.key] for t in trials if t.key in latest]
