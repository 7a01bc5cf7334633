"""Reliability, third round (issue 34), the leaderboard harness's side: an executor plugin's rows are matched to the
trials it was given before anything is written; register_plugin keeps no plugin that fails its checks; a full disk
leaves no partial line; an ok row of another configuration is never a trial's result; a context no model can hold
is refused before any task is built; Ray's start-up timeout is one clear message. Each test failed on the code
before its fix. (The CLI's bad-input cases of this round are rows of test_bad_inputs.py.)"""

from __future__ import annotations

import errno
import json
import os
import sys
import types
from pathlib import Path
from typing import ClassVar

import pytest

from kvzoo import TieredCache, registry
from kvzoo.bench import plots, runner, tasks
from kvzoo.bench.executors import ExecutorError, Work
from kvzoo.bench.tasks import TaskSpec
from kvzoo.cli import main
from kvzoo.framework.adapters.gqa import GQAAdapter
from kvzoo.models import tiny_llama

pytestmark = pytest.mark.usefixtures("clean_registry")  # tests/conftest.py


def _cli(args: list[str]) -> int:
    """Run the CLI; argparse's refusals become the exit code they would have been."""
    try:
        return main(args)
    except SystemExit as stop:
        return stop.code


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


# --- test executors: rows of the trials given, without running them -----------------------------------------

# `kvzoo leaderboard --preset tiny` narrowed to three trials: full, streaming_llm 2x and 4x, question after
THREE_TRIALS = ["leaderboard", "--preset", "tiny", "--policies", "full,streaming_llm", "--ratios", "2", "4",
                "--positions", "after", "--no-plots", "--no-progress"]
INFO = {"worker": "test", "trial_seconds": 0.0, "model_load_s": 0.0, "attempts": 1, "attempt_errors": []}


def _trials(work: Work) -> list:
    return [trial for group in work.groups for trial in group.trials]


def _row(work: Work, trial) -> dict:
    """A valid row of ``trial`` without running it (the row of a trial no worker could finish)."""
    return work.failed_row(trial, "not run: a test executor")


class _TestExecutor:
    summary = "a test executor"

    @classmethod
    def add_arguments(cls, group) -> None:
        """No options."""


def _register_executor(cls: type) -> None:
    @registry.hookimpl
    def kvzoo_executors():
        return [cls]

    registry.register_plugin(types.SimpleNamespace(kvzoo_executors=kvzoo_executors), name=f"test-{cls.name}")


# --- an executor plugin's rows are matched to the trials it was given ---------------------------------------------

class FirstRowForAll(_TestExecutor):
    name = "first_row"

    def run(self, work, emit):
        trials = _trials(work)
        first = _row(work, trials[0])
        for trial in trials:
            emit(trial, dict(first), dict(INFO))


class EachTwice(_TestExecutor):
    name = "twice"

    def run(self, work, emit):
        for trial in _trials(work):
            emit(trial, _row(work, trial), dict(INFO))
            emit(trial, _row(work, trial), dict(INFO))


class RunsNothing(_TestExecutor):
    name = "nothing"

    def run(self, work, emit):
        return None


class RaisesAfterOne(_TestExecutor):
    name = "raises"

    def run(self, work, emit):
        trial = _trials(work)[0]
        emit(trial, _row(work, trial), dict(INFO))
        raise RuntimeError("the cluster went away")


class NonRow(_TestExecutor):
    name = "non_row"

    def run(self, work, emit):
        emit(_trials(work)[0], "a row, honest", dict(INFO))


class HalfRow(_TestExecutor):
    name = "half_row"

    def run(self, work, emit):
        trial = _trials(work)[0]
        emit(trial, {"key": trial.key, "status": "ok"}, dict(INFO))


class ForeignTrial(_TestExecutor):
    name = "foreign"

    def run(self, work, emit):
        import dataclasses

        trial = dataclasses.replace(_trials(work)[0], position="before")  # not one of the trials it was given
        emit(trial, _row(work, trial), dict(INFO))


class SwallowsRefusals(_TestExecutor):
    """Emits the first trial's row for every trial, and carries on when told no."""

    name = "swallows"

    def run(self, work, emit):
        trials = _trials(work)
        first = _row(work, trials[0])
        for trial in trials:
            try:
                emit(trial, dict(first), dict(INFO))
            except Exception:  # noqa: BLE001 - the point of this executor
                pass


@pytest.mark.parametrize(("executor", "rows_written", "message"), [
    (FirstRowForAll, 1, r"the row it returned for streaming_llm 2x .* is another trial's \(key='tiny-llama\|.*\|full\|"),
    (EachTwice, 1, r"emit\(\) was called a second time for full niah_single"),
    (RunsNothing, 0, r"returned no row for 3 of the 3 trials it was given \(full niah_single d=0\.5 q-after, "
                     r"streaming_llm 2x .*, streaming_llm 4x .*\): they were not run"),
    (RaisesAfterOne, 1, r"raised RuntimeError: the cluster went away after returning 1 of the 3 trials' rows"),
    (NonRow, 0, r"its row for full niah_single d=0\.5 q-after is a str \('a row, honest'\), not a dict"),
    (HalfRow, 0, r"its row for full .* is not a kvzoo results row: \(no 'model', 'policy', 'task', "
                 r"'question_position'\)"),
    (ForeignTrial, 0, r"emit\(\) was called for full niah_single d=0\.5 q-before \(trial key .*\), which is not one "
                      r"of the 3 trials it was given"),
    (SwallowsRefusals, 1, r"the row it returned for streaming_llm 2x .* is another trial's"),
], ids=lambda value: getattr(value, "name", None))
def test_an_executors_rows_are_matched_to_its_trials_before_anything_is_written(tmp_path, capsys, executor,
                                                                               rows_written, message):
    """Before: the first trial's row for every trial wrote 3 rows under one key (exit 0), each trial twice wrote 6
    rows (exit 0), nothing run exited 1 without a word, a raise or a non-row was a traceback (the non-row appended
    first). Now each row must be one of the trials given, once, a kvzoo row keyed as that trial; anything else ends
    the run with exit 1 and an error naming the executor plugin and the contract; only checked rows are written."""
    _register_executor(executor)
    out = tmp_path / "r.jsonl"
    assert _cli([*THREE_TRIALS, "--executor", executor.name, "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert f"executor {executor.name!r} ({executor.__module__}:{executor.__qualname__})" in err
    assert pytest.importorskip("re").search(message, err), err
    if executor is not RaisesAfterOne:  # a refusal states the contract; an exception is the executor's own
        assert "emit(trial, row, run_info) exactly once for each trial" in err
    rows = _lines(out)
    assert len(rows) == rows_written and [r["policy"] for r in rows] == ["full"] * rows_written
    assert len({r["key"] for r in rows}) == len(rows)
    assert out.exists() == bool(rows_written)  # a run that wrote nothing leaves no file behind


def test_a_run_whose_executor_broke_the_contract_resumes_with_the_trials_that_have_no_row(tmp_path, capsys):
    """The rows written before a refusal are the trials' own: rerunning with the local executor runs the other two."""
    _register_executor(FirstRowForAll)
    out = tmp_path / "r.jsonl"
    assert _cli([*THREE_TRIALS, "--executor", "first_row", "--out", str(out)]) == 1
    capsys.readouterr()
    pending: list[str] = []

    class Recording(_TestExecutor):
        name = "recording"

        def run(self, work, emit):
            for trial in _trials(work):
                pending.append(trial.label)
                emit(trial, _row(work, trial), dict(INFO))

    _register_executor(Recording)
    assert _cli([*THREE_TRIALS, "--executor", "recording", "--out", str(out)]) == 1  # every row is an error row
    assert pending == ["full niah_single d=0.5 q-after", "streaming_llm 2x niah_single d=0.5 q-after",
                       "streaming_llm 4x niah_single d=0.5 q-after"]  # full's error row is retried, as any error
    assert [r["policy"] for r in _lines(out)] == ["full", "full", "streaming_llm", "streaming_llm"]


def test_run_grid_raises_executor_error_for_an_executor_that_runs_nothing(tmp_path):
    grid = runner.Grid(models=("tiny-llama",), policies=("full",), tasks=(TaskSpec("niah_single", 256, 0.5),),
                       positions=("after",), max_new_tokens=2, continuation_tokens=0)
    with pytest.raises(ExecutorError, match=r"executor 'nothing' .* returned no row for 1 of the 1 trials"):
        runner.run_grid(grid, tmp_path / "r.jsonl", progress=False, executor=RunsNothing())
    assert not (tmp_path / "r.jsonl").exists()


# --- register_plugin keeps no plugin that fails its checks ----------------------------------------------------


class ClaimsLlama(GQAAdapter):
    name: ClassVar[str] = "claims_llama"
    model_types: ClassVar[tuple[str, ...]] = ("llama",)  # a built-in adapter serves it


class TypesAsStr(GQAAdapter):
    name: ClassVar[str] = "types_as_str"
    model_types: ClassVar[str] = "toy_llama"  # a str, not a tuple of them


class NotAnAdapter:
    name = "not_an_adapter"


class LocalAgain(_TestExecutor):
    name = "local"  # the built-in executor's name

    def run(self, work, emit):
        raise AssertionError("never registered")


def _adapters(*classes):
    @registry.hookimpl
    def kvzoo_adapters():
        return list(classes)

    return types.SimpleNamespace(kvzoo_adapters=kvzoo_adapters)


def _executors(*classes):
    @registry.hookimpl
    def kvzoo_executors():
        return list(classes)

    return types.SimpleNamespace(kvzoo_executors=kvzoo_executors)


@pytest.mark.parametrize(("plugin", "message"), [
    (lambda: _adapters(ClaimsLlama), r"kvzoo_adapters: 'llama' is claimed twice: by built-in plugin 'kvzoo\.builtins' "
                                     r".* and by plugin 'bad', class .*ClaimsLlama"),
    (lambda: _adapters(TypesAsStr), r"plugin 'bad': adapter .*TypesAsStr needs model_types: "
                                    r"ClassVar\[tuple\[str, \.\.\.\]\].*\(got 'toy_llama'\)"),
    (lambda: _adapters(NotAnAdapter), r"plugin 'bad': adapter .*NotAnAdapter needs model_types"),
    (lambda: _executors(LocalAgain), r"kvzoo_executors: 'local' is claimed twice: by built-in plugin "
                                     r"'kvzoo\.builtins' .* and by plugin 'bad', class .*LocalAgain"),
], ids=["adapter claiming llama", "model_types a str", "no adapter", "executor named local"])
def test_a_plugin_that_fails_registration_is_not_kept(plugin, message):
    """Before: each was kept (register_plugin checked only the policy tables), and the next TieredCache on any model
    failed until it was unregistered. Now register_plugin refuses it naming what was wrong, and the registry is as
    it was: the built-in Llama still gets a cache, the executors are the built-in ones."""
    with pytest.raises(registry.RegistryError, match=message):
        registry.register_plugin(plugin(), name="bad")
    with pytest.raises(KeyError, match="'bad' is not a registered plugin"):
        registry.unregister_plugin("bad")
    TieredCache(tiny_llama()[0], "full").close()
    assert list(registry.executors()) == ["local", "ray"]
    assert registry.adapters()["llama"].__name__ == "GQAAdapter"


# --- a full disk while appending a row ------------------------------------------------------------------------


def _row_of(key: str) -> dict:
    return {"key": key, "status": "ok", "model": "m", "policy": "full", "task": "niah_single",
            "question_position": "after", "ratio": None, "answer_nll": 1.0, "score": 1.0, "text": "x" * 200}


def _disk_fills_up(monkeypatch, path: Path, after_rows: int, fits: int = 40) -> None:
    """``os.write`` to ``path`` as on a disk that fills up: ``after_rows`` writes go through, the next takes ``fits``
    bytes, the one after fails with ENOSPC. Writes to anything else go through."""
    real_write, writes = os.write, []

    def write(fd, data):
        if path.exists() and os.path.samestat(os.fstat(fd), os.stat(path)):
            writes.append(len(data))
            if len(writes) == after_rows + 1:
                return real_write(fd, bytes(data[:fits]))
            if len(writes) > after_rows + 1:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", write)


def test_a_row_that_does_not_fit_on_the_disk_leaves_no_partial_line(tmp_path, monkeypatch):
    """Before: the OSError escaped and a 40-byte partial line stayed. Now the file is cut back to its length and the
    error names the file and the full disk; the next append starts clean."""
    path = tmp_path / "r.jsonl"
    runner.append_row(path, _row_of("a"))
    before = path.read_bytes()
    _disk_fills_up(monkeypatch, path, after_rows=0)
    with pytest.raises(runner.ResultsWriteError, match=rf"could not append a row to {path} \(ENOSPC: No space left on "
                                                       r"device; the disk is full\): the row was not written"):
        runner.append_row(path, _row_of("b"))
    assert path.read_bytes() == before
    monkeypatch.undo()
    runner.append_row(path, _row_of("c"))
    assert [r["key"] for r in runner.read_results(path)] == ["a", "c"]
    assert runner.read_results_file(path).bad_lines == []


def test_a_full_disk_ends_the_leaderboard_with_a_message_naming_the_file(tmp_path, monkeypatch, capsys):
    """``kvzoo leaderboard`` on a disk that fills up at its second row: exit 1, no traceback, the message names the
    file, and the file holds the first row whole and nothing else."""
    out = tmp_path / "r.jsonl"
    _disk_fills_up(monkeypatch, out, after_rows=1)
    code = _cli(["leaderboard", "--preset", "tiny", "--policies", "full,streaming_llm", "--ratios", "2",
                 "--positions", "after", "--max-new-tokens", "2", "--continuation-tokens", "0", "--no-plots",
                 "--no-progress", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 1, err
    assert f"could not append a row to {out} (ENOSPC" in err and "the disk is full" in err
    assert out.read_bytes().endswith(b"\n") and [r["policy"] for r in _lines(out)] == ["full"]


# --- an ok row of another configuration is never a trial's result ----------------------------------------------


def _stale_results(path: Path) -> tuple[runner.Grid, list[runner.Trial]]:
    """A results file as a changed default leaves it: full's ok row, streaming_llm 2x's ok row of the old
    configuration (sinks=5, the name builds sinks=4 now), then the rerun's error row of the same trial."""
    grid = runner.Grid(models=("tiny-llama",), policies=("full", "streaming_llm"), ratios=(2,),
                       tasks=(TaskSpec("niah_single", 256, 0.5),), positions=("after",), max_new_tokens=2,
                       continuation_tokens=0)
    trials = runner.plan(grid)
    for trial in trials:
        config = runner.build_policy(trial.policy, trial.ratio).config()
        if trial.policy == "streaming_llm":
            assert config["sinks"] == 4
            config["sinks"] = 5
        runner.append_row(path, {**runner.trial_row(trial), "policy_config": config, "retriever_config": None,
                                 "answer_nll": 1.0, "score": 1.0})
    runner.append_row(path, runner.trial_row(trials[1], "error", "RuntimeError: the rerun failed"))
    return grid, trials


def test_a_stale_ok_row_is_not_plotted_and_plot_says_so(tmp_path, monkeypatch, capsys):
    """Before: latest_rows took the old ok row over the rerun's error row, and `kvzoo plot` drew it (exit 0). Now a
    row of another configuration than its name builds is passed over: the trial's row is the error row, as the
    leaderboard's table says, and plot names the trial it leaves out."""
    path = tmp_path / "r.jsonl"
    _stale_results(path)
    drawn: list[dict] = []
    monkeypatch.setattr(plots, "write_plots", lambda rows, out_dir, **kw: drawn.extend(rows) or [])
    assert _cli(["plot", str(path), "--out-dir", str(tmp_path)]) == 0
    assert [(r["policy"], r["status"]) for r in drawn] == [("full", "ok"), ("streaming_llm", "error")]
    err = capsys.readouterr().err
    assert "1 trial(s) whose ok row ran another configuration than its policy name builds now are not plotted" in err
    assert "streaming_llm 2x niah_single d=0.5 q-after: ran with policy_config sinks=5 (now 4)" in err
    latest, stale = runner.current_rows(runner.read_results(path))
    assert [r["status"] for r in latest.values()] == ["ok", "error"] and len(stale) == 1


def test_resume_and_the_table_agree_with_plot_on_a_stale_row(tmp_path, capsys):
    """Resuming runs the stale trial again (and only it), and the rows run_grid returns (the table's) are the new
    ones: this held before the fix (resume checked the configuration, the table read the rows in memory); it is
    here so that the three readers stay in agreement now that plot reads the file the same way."""
    path = tmp_path / "r.jsonl"
    grid, trials = _stale_results(path)
    handed: list[str] = []

    class Recording(_TestExecutor):
        name = "recording"

        def run(self, work, emit):
            for trial in _trials(work):
                handed.append(trial.key)
                emit(trial, _row(work, trial), dict(INFO))

    rows = runner.run_grid(grid, path, progress=False, executor=Recording())
    assert handed == [trials[1].key]
    assert [(r["policy"], r["status"]) for r in rows] == [("full", "ok"), ("streaming_llm", "error")]
    assert "its row ran with policy_config sinks=5 (now 4); running it again" in capsys.readouterr().err


# --- a context no model can hold is refused before any task is built -------------------------------------------


@pytest.fixture
def no_task_is_built(monkeypatch):
    """Building a context fails the test: a refusal must come first (a 10^8-token task took 582 s to build)."""
    def built(*args, **kwargs):
        raise AssertionError("a task was built before the positions check")

    for module, name in ((tasks, "make_task"), (tasks, "build_needle_context"), (runner, "make_task")):
        monkeypatch.setattr(module, name, built)


@pytest.mark.parametrize("argv", [
    ["run", "--model", "tiny-llama", "--context-tokens", "100000000"],
    ["run", "--model", "tiny-llama", "--task", "niah_single", "--context-tokens", "100000000"],
    ["leaderboard", "--preset", "tiny", "--context-tokens", "100000000", "--no-progress"],
], ids=["run", "run --task", "leaderboard"])
def test_a_context_past_the_models_positions_is_refused_before_a_task_is_built(tmp_path, capsys, no_task_is_built,
                                                                               argv):
    out = tmp_path / "r.jsonl"
    extra = ["--out", str(out)] if argv[0] == "leaderboard" else []
    assert _cli([*argv, *extra]) == 2
    err = capsys.readouterr().err
    assert "--context-tokens 100000000 cannot fit model 'tiny-llama': the context alone holds at least 99000000 " \
           "tokens, more than its max_position_embeddings (4096)" in err
    assert not out.exists()


def test_run_grid_and_a_trial_refuse_a_context_past_the_positions_before_building_it(tmp_path, no_task_is_built):
    grid = runner.Grid(models=("tiny-llama",), policies=("full",), tasks=(TaskSpec("niah_single", 10**8, 0.5),),
                       positions=("after",), continuation_tokens=0)
    with pytest.raises(ValueError, match=r"context_tokens=100000000 cannot fit model 'tiny-llama'"):
        runner.run_grid(grid, tmp_path / "r.jsonl", progress=False)
    assert not (tmp_path / "r.jsonl").exists()
    row = runner.TrialRunner(grid).run(runner.plan(grid)[0], None)  # a trial on its own: an error row, at once
    assert row["status"] == "error" and "context_tokens=100000000 cannot fit model 'tiny-llama'" in row["error"]


# --- Ray's start-up timeout is one clear message --------------------------------------------------------------


class _FakeRay(types.SimpleNamespace):
    """What kvzoo's Ray executor calls before a worker starts, with ``ray.init`` raising ``error``."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(shutdowns=0)
        self.error = error

    def is_initialized(self) -> bool:
        return False

    def init(self, **kwargs) -> None:
        raise self.error

    def shutdown(self) -> None:
        self.shutdowns += 1


# ray/_private/node.py (Ray 2.60): a local node whose raylet is not up in 30 s is a bare Exception; older releases
# raised ray._private.services.wait_for_node's TimeoutError
STARTUP_TIMEOUT = Exception("The current node timed out during startup. This could happen because some of the raylet "
                            "failed to startup or the GCS has become overloaded.")


@pytest.mark.parametrize(("error", "address", "message"), [
    (STARTUP_TIMEOUT, [], r"could not start a local Ray instance \(Exception: The current node timed out during "
                          r"startup\..*\)\. A machine under heavy load"),
    (TimeoutError("Timed out after 60 seconds while waiting for node to startup."), [],
     r"could not start a local Ray instance \(TimeoutError: Timed out after 60 seconds"),
    (STARTUP_TIMEOUT, ["--address", "auto"], r"could not connect to the Ray cluster at 'auto' \(Exception: The current "
                                             r"node timed out during startup"),
], ids=["local, Ray 2.x", "local, older Ray", "--address auto"])
def test_rays_start_up_timeout_is_a_clear_message_not_a_traceback(tmp_path, monkeypatch, capsys, error, address,
                                                                  message):
    """Seen once under heavy load: ray.init's start-up timeout escaped `kvzoo leaderboard --executor ray` as a
    traceback. Faked here (ray.init raising what Ray raises): exit 2, the message says what happened and what to
    do, the half-started Ray is shut down, nothing is written."""
    fake = _FakeRay(error)
    monkeypatch.setitem(sys.modules, "ray", fake)
    out = tmp_path / "r.jsonl"
    assert _cli([*THREE_TRIALS, "--executor", "ray", "--workers", "1", *address, "--out", str(out)]) == 2
    assert pytest.importorskip("re").search(message, capsys.readouterr().err)
    assert fake.shutdowns == 1 and not out.exists()
