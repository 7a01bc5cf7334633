"""The executor seam (kvzoo.bench.executors) without Ray: the trial queue, the local executor's run info,
choosing an executor, the CLI's errors, the worker summary, a Ctrl-C held until a row's line is whole."""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
from pathlib import Path

import pytest

from kvzoo import registry
from kvzoo.bench import report, runner
from kvzoo.bench.executors import LocalExecutor, TrialGroup, TrialQueue
from kvzoo.bench.tasks import TaskSpec
from kvzoo.cli import main

TASKS = (TaskSpec("niah_single", 384, 0.5), TaskSpec("niah_single", 384, 0.25))


pytestmark = pytest.mark.usefixtures("clean_registry")  # tests/conftest.py


def grid(**fields) -> runner.Grid:
    base = dict(models=("tiny-llama",), policies=("full", "streaming_llm"), ratios=(2, 4), tasks=TASKS[:1],
                positions=("after",), max_new_tokens=4, continuation_tokens=16)
    return runner.Grid(**{**base, **fields})


# --- grouping and handing out trials -------------------------------------------------------------------


def test_trials_group_by_model_task_and_position_with_the_pending_reference_first():
    trials = runner.plan(grid(tasks=TASKS, positions=("after", "before")))
    groups = runner.group_trials(trials)
    assert len(groups) == 4 and [len(g.trials) for g in groups] == [3, 3, 3, 3]
    assert all(g.first_is_reference and g.trials[0].policy == "full" for g in groups)
    assert [t for g in groups for t in g.trials] == trials  # plan order kept
    resumed = runner.group_trials([t for t in trials if t.policy != "full"])  # references finished earlier
    assert [g.first_is_reference for g in resumed] == [False] * 4 and [len(g.trials) for g in resumed] == [2] * 4


def test_queue_holds_a_group_until_its_reference_row_is_in_then_shares_it():
    a = TrialGroup("a", "m", ["a-ref", "a1", "a2", "a3"], first_is_reference=True)
    b = TrialGroup("b", "m", ["b-ref", "b1"], first_is_reference=True)
    queue = TrialQueue([a, b])
    assert queue.take() == (a, "a-ref")
    assert queue.take() == (b, "b-ref")  # a waits for its reference: the second worker starts b
    assert queue.take() is None and len(queue) == 4  # nothing ready until a reference row is in
    queue.finished(a, "a-ref")
    assert queue.take("a", "m") == (a, "a1")
    assert queue.take("b", "m") == (a, "a2")  # b still waits: a's trials go to any worker
    queue.retry(a, "a2")  # its worker died: back to the front
    assert queue.take("a", "m") == (a, "a2")
    queue.finished(b, "b-ref")
    assert queue.take("b", "m") == (b, "b1")  # a worker keeps to its own group
    assert queue.take("b", "m") == (a, "a3") and len(queue) == 0


def test_queue_starts_a_new_group_before_helping_and_keeps_to_the_workers_model():
    a = TrialGroup("a", "m1", ["a1", "a2", "a3"])  # reference finished in an earlier run
    b = TrialGroup("b", "m2", ["b-ref", "b1"], first_is_reference=True)
    c = TrialGroup("c", "m1", ["c-ref", "c1"], first_is_reference=True)
    queue = TrialQueue([a, b, c])
    assert queue.take("a", "m1") == (a, "a1")
    assert queue.take(None, "m1") == (c, "c-ref")  # same model, a new group (its reference unblocks work)
    assert queue.take(None, "m2") == (b, "b-ref")
    assert queue.take(None, "m1") == (a, "a2")
    queue.retry(b, "b-ref")  # the reference lost its worker: it is handed out again, first
    assert queue.take(None, "m2") == (b, "b-ref")


# --- the local executor ----------------------------------------------------------------------------------


def test_local_executor_rows_say_which_process_ran_them_and_keep_model_loading_apart(tmp_path: Path):
    rows = runner.run_grid(grid(), tmp_path / "r.jsonl", progress=False, executor=LocalExecutor())
    assert [(r["policy"], r["ratio"], r["status"]) for r in rows] == [
        ("full", None, "ok"), ("streaming_llm", 2.0, "ok"), ("streaming_llm", 4.0, "ok")]
    assert {r["worker"] for r in rows} == {f"{socket.gethostname()}:{os.getpid()}"}
    assert all(r["attempts"] == 1 and r["attempt_errors"] == [] and 0 < r["trial_seconds"] < r["wall_s"] + 1
               for r in rows)
    assert rows[0]["model_load_s"] > 0 and [r["model_load_s"] for r in rows[1:]] == [0.0, 0.0]
    table = report.worker_table(rows).splitlines()
    assert table[2].startswith(f"| {rows[0]['worker']} | 3 | 0 | ")


def test_make_executor_names_the_valid_ones_and_refuses_ray_options_for_local():
    assert isinstance(runner.make_executor("local"), LocalExecutor)
    with pytest.raises(ValueError, match="unknown executor 'dask': valid executors are local, ray"):
        runner.make_executor("dask")
    with pytest.raises(ValueError, match="takes no options .got workers"):
        runner.make_executor("local", workers=2)


def test_cli_ray_executor_without_ray_fails_with_the_install_command(monkeypatch, capsys, tmp_path: Path):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError, as without the extra
    code = main(["leaderboard", "--preset", "tiny", "--executor", "ray", "--workers", "2",
                 "--out", str(tmp_path / "x.jsonl")])
    assert code == 2
    assert "pip install 'kvzoo[ray]'" in capsys.readouterr().err
    assert not (tmp_path / "x.jsonl").exists()


def test_cli_ray_options_need_the_ray_executor_and_valid_numbers(capsys, tmp_path: Path):
    assert main(["leaderboard", "--preset", "tiny", "--workers", "2", "--gpus-per-worker", "0.5",
                 "--out", str(tmp_path / "x.jsonl")]) == 2
    assert "--workers, --gpus-per-worker only apply to --executor ray" in capsys.readouterr().err
    for bad in (["--workers", "0"], ["--gpus-per-worker", "-1"], ["--cpus-per-worker", "0"], ["--executor", "dask"]):
        with pytest.raises(SystemExit) as exit_info:
            main(["leaderboard", "--preset", "tiny", *bad])
        assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--workers is an int >= 1, got '0'" in err and "--gpus-per-worker is a number >= 0" in err
    assert "--cpus-per-worker is a number > 0" in err and "invalid choice: 'dask'" in err


def test_an_executor_registered_from_outside_brings_its_own_option(monkeypatch, capsys, tmp_path: Path):
    """tests/plugin_executor.py: one file, registered through the kvzoo_executors hook, is a new --executor with
    its own --tag; the option is refused with another executor; an unknown executor's error names the new one."""
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    import plugin_executor

    registry.register_plugin(plugin_executor)
    assert list(registry.executors()) == ["local", "ray", "reversed"]
    with pytest.raises(ValueError, match="valid executors are local, ray, reversed"):
        runner.make_executor("dask")
    out = tmp_path / "r.jsonl"
    assert main(["leaderboard", "--preset", "tiny", "--policies", "full,streaming_llm", "--ratios", "2", "4",
                 "--positions", "after", "--executor", "reversed", "--tag", "mine", "--out", str(out),
                 "--no-plots", "--no-progress"]) == 0
    rows = runner.read_results(out)
    assert [(r["policy"], r["ratio"]) for r in rows] == [("full", None), ("streaming_llm", 4.0), ("streaming_llm", 2.0)]
    assert {r["worker"] for r in rows} == {"mine"} and rows[1]["delta_nll"] is not None
    assert main(["leaderboard", "--preset", "tiny", "--tag", "x", "--out", str(tmp_path / "x.jsonl")]) == 2
    assert "--tag only apply to --executor reversed" in capsys.readouterr().err


# --- the summary and the results file ------------------------------------------------------------------------


def test_worker_table_counts_trials_retries_time_and_memory_per_worker():
    rows = [
        {"worker": "h:1", "trial_seconds": 2.0, "attempts": 1, "policy": "full", "ratio": None, "task": "vt",
         "depth": 0.5, "question_position": "after", "peak_rss_bytes": 3 * 2**20},
        {"worker": "h:1", "trial_seconds": 4.0, "attempts": 2, "policy": "h2o", "ratio": 2.0, "task": "vt",
         "depth": 0.5, "question_position": "after", "peak_rss_bytes": 5 * 2**20},
        {"worker": None, "trial_seconds": None, "attempts": 3, "policy": "h2o", "ratio": 4.0, "task": "vt"},
        {"policy": "full", "ratio": None, "task": "vt"},  # written before workers were recorded
    ]
    lines = report.worker_table(rows).splitlines()
    assert lines[2] == "| (lost) | 1 | 1 | 0.0 | n/a | n/a | n/a |"
    assert lines[3] == "| (not recorded) | 1 | 0 | 0.0 | n/a | n/a | n/a |"
    assert lines[4] == "| h:1 | 2 | 1 | 6.0 | 3.00 | h2o 2x vt d=0.5 q-after (4.0 s) | 5.0 MiB |"


def test_a_ctrl_c_during_a_row_write_waits_until_the_line_is_whole(tmp_path: Path, monkeypatch):
    path = tmp_path / "r.jsonl"
    real_fsync = os.fsync

    def interrupted_fsync(fd):  # Ctrl-C arrives in the middle of the write
        signal.raise_signal(signal.SIGINT)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", interrupted_fsync)
    # Python keeps SIGINT ignored when it starts with it ignored (a job started with `&` by a script, as some CI
    # runners do): the test needs Ctrl-C's usual handler, whatever the process inherited
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            runner.append_row(path, {"key": "a", "status": "ok", "text": "x" * 10_000})
        assert json.loads(path.read_text())["text"] == "x" * 10_000  # whole, then interrupted
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, inherited)
