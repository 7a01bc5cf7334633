"""Regression tests for the second reliability probe (issue 22), one block per finding. Bad-input cases
that are plain refusals live in the matrix, ``tests/reliability/test_bad_inputs.py``; the Ray cases (finding 3)
in ``tests/ray/test_placement.py``."""

from __future__ import annotations

import builtins
import json
import os
import pathlib
import subprocess
import sys
import threading

import pytest
import torch

from kvzoo import TieredCache, pipeline, registry
from kvzoo.bench import runner
from kvzoo.cli import _grid_from_args, build_parser, main
from kvzoo.models import tiny_deepseek_v2, tiny_llama

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"
# one trial: the tiny preset's reference on the question-after column
ONE_TRIAL = ["leaderboard", "--preset", "tiny", "--policies", "full", "--positions", "after", "--no-plots",
             "--no-progress", "--max-new-tokens", "2", "--continuation-tokens", "8"]


def _ids(n, seed=0, vocab=256):
    return torch.randint(1, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


def _cli(args):
    try:
        return main(args)
    except SystemExit as stop:
        return stop.code


def _lines(path):
    return path.read_text().splitlines()


@pytest.fixture(scope="module")
def ok_row(tmp_path_factory):
    """The one real row of ONE_TRIAL (status ok), run once for the module."""
    out = tmp_path_factory.mktemp("one") / "one.jsonl"
    assert main([*ONE_TRIAL, "--out", str(out)]) == 0
    (row,) = [json.loads(line) for line in _lines(out)]
    assert row["status"] == "ok"
    return row


@pytest.fixture
def no_trials(monkeypatch):
    """Fail the test if any trial starts (what must be refused is refused before anything runs)."""
    def refuse(*args, **kwargs):
        raise AssertionError("a trial ran")

    monkeypatch.setattr(runner, "run_trial", refuse)


@pytest.fixture
def read_only(tmp_path, monkeypatch):
    """A folder that refuses writes, as a read-only mount refuses them even to root (these tests run as root in
    CI, where permission bits refuse nothing): opening anything inside it for writing, or creating a file in it,
    raises PermissionError; reading works."""
    folder = tmp_path / "ro"
    folder.mkdir()
    inside = str(folder)
    real_os_open, real_open = os.open, builtins.open
    writing = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC | getattr(os, "O_TMPFILE", 0)

    def denied(path):
        path = os.path.abspath(os.fspath(path)) if isinstance(path, (str, os.PathLike)) else ""
        return path == inside or path.startswith(inside + os.sep)

    def os_open(path, flags, *args, **kwargs):
        if flags & writing and denied(path):
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return real_os_open(path, flags, *args, **kwargs)

    def open_(file, mode="r", *args, **kwargs):
        if any(c in mode for c in "wax+") and denied(file):
            raise PermissionError(13, "Permission denied", os.fspath(file))
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr(os, "open", os_open)
    monkeypatch.setattr(builtins, "open", open_)
    return folder


# --- 1. --force --fresh never deletes a file that is not kvzoo's ---------------------------------------------


def test_force_fresh_refuses_a_file_that_is_not_kvzoos_and_leaves_it_whole(tmp_path, capsys, no_trials):
    notes = tmp_path / "notes.md"
    notes.write_bytes(README.read_bytes())
    assert _cli([*ONE_TRIAL, "--out", str(notes), "--force", "--fresh"]) == 2
    assert notes.read_bytes() == README.read_bytes()
    err = capsys.readouterr().err
    assert "not a kvzoo results file" in err and "--fresh would delete it" in err and "--force" in err
    assert "stays in the file" not in err  # no promise to keep lines, then a deletion


def test_fresh_alone_refuses_a_file_that_is_not_kvzoos_too(tmp_path, capsys, no_trials):
    notes = tmp_path / "notes.md"
    notes.write_text("# notes\n")
    assert _cli([*ONE_TRIAL, "--out", str(notes), "--fresh"]) == 2
    assert notes.read_text() == "# notes\n"
    assert "never deletes or truncates a file that is not its own" in capsys.readouterr().err


# --- 2. --fresh keeps a user's own lines in a kvzoo file (it refuses, saying what would be lost) ----------------


def test_fresh_on_kvzoo_results_with_a_users_lines_refuses_and_keeps_every_line(tmp_path, ok_row, capsys, no_trials):
    out = tmp_path / "r.jsonl"
    content = json.dumps(ok_row) + "\nmy own note about this run\n"
    out.write_text(content)
    assert _cli([*ONE_TRIAL, "--out", str(out), "--fresh"]) == 2
    assert out.read_text() == content
    err = capsys.readouterr().err
    assert "holds 1 line(s) that are not kvzoo rows (line 2" in err and "nothing was deleted" in err


def test_fresh_on_a_file_of_kvzoo_rows_only_still_starts_over(tmp_path, ok_row):
    out = tmp_path / "r.jsonl"
    stale = {**ok_row, "key": ok_row["key"].replace("tiny-llama", "gone-model"), "model": "gone-model"}
    out.write_text(json.dumps(stale) + "\n" + json.dumps(ok_row) + "\n")
    assert main([*ONE_TRIAL, "--out", str(out), "--fresh"]) == 0
    rows = [json.loads(line) for line in _lines(out)]
    assert [r["key"] for r in rows] == [ok_row["key"]] and rows[0]["finished_at"] >= ok_row["finished_at"]
    assert rows[0]["model"] == "tiny-llama"  # the stale row went with the rest of the file


# --- 4. a cache is bound to its model's identity and layout --------------------------------------------------


def test_a_cache_refuses_another_llama_that_has_a_tiered_cache_of_its_own():
    first, second = tiny_llama(seed=0)[0], tiny_llama(seed=1)[0]
    cache = TieredCache(first, registry.get("full"))
    TieredCache(second, registry.get("full"))  # the second model runs kvzoo's attention too
    with torch.no_grad():
        first(input_ids=_ids(20), cache=cache, use_cache=True)
        with pytest.raises(RuntimeError, match="belongs to the model it was created for"):
            second(input_ids=_ids(1, seed=1), cache=cache, use_cache=True)
        # the refused forward's rows reached layer 0 first: the cache says so rather than decode on them
        with pytest.raises(RuntimeError, match="can no longer be used"):
            first(input_ids=_ids(1, seed=1), cache=cache, use_cache=True)
        cache.close()  # emptied, it serves its own model again
        first(input_ids=_ids(5), cache=cache, use_cache=True)
    assert cache.get_seq_length() == 5


def test_an_mla_cache_refuses_another_deepseek_before_any_row_goes_in():
    first, second = tiny_deepseek_v2(seed=0)[0], tiny_deepseek_v2(seed=1)[0]
    cache, reference = TieredCache(first, registry.get("full")), TieredCache(first, registry.get("full"))
    TieredCache(second, registry.get("full"))
    with torch.no_grad():
        for c in (cache, reference):
            first(input_ids=_ids(12, vocab=512), cache=c, use_cache=True)
        with pytest.raises(RuntimeError, match="belongs to the model it was created for"):
            second(input_ids=_ids(1, seed=1, vocab=512), cache=cache, use_cache=True)
        assert cache.get_seq_length() == 12  # nothing went in
        step = first(input_ids=_ids(1, seed=1, vocab=512), cache=cache, use_cache=True).logits
        expected = first(input_ids=_ids(1, seed=1, vocab=512), cache=reference, use_cache=True).logits
    torch.testing.assert_close(step, expected, rtol=1e-5, atol=1e-5)


def test_a_gqa_model_cannot_write_into_an_mla_cache():
    deepseek, llama = tiny_deepseek_v2()[0], tiny_llama(num_hidden_layers=2)[0]
    cache = TieredCache(deepseek, registry.get("full"))
    TieredCache(llama, registry.get("full"))
    with torch.no_grad():
        deepseek(input_ids=_ids(8, vocab=512), cache=cache, use_cache=True)
        with pytest.raises(RuntimeError, match="built for an MLA model and received keys and values"):
            llama(input_ids=_ids(4), cache=cache, use_cache=True)
    assert cache.get_seq_length() == 8


# --- 5. fork() of a cache filled with autograd on -----------------------------------------------------------------


@pytest.mark.parametrize("name", ["full", "h2o", "snapkv"])
def test_fork_of_a_cache_filled_with_gradients_on_says_to_use_no_grad(tiny, name):
    params = {} if name == "full" else {"budget": 40, **({"window": 8} if name == "snapkv" else {})}
    cache = TieredCache(tiny, registry.get(name, **params))
    assert torch.is_grad_enabled()
    tiny(input_ids=_ids(60), cache=cache, use_cache=True)  # a plain forward, gradients on
    with pytest.raises(RuntimeError, match=r"fill it under torch\.no_grad\(\)"):
        cache.fork()


def test_the_public_pipeline_steps_fill_a_cache_that_forks_with_gradients_on(tiny):
    cache = TieredCache(tiny, registry.get("h2o", budget=40))
    assert torch.is_grad_enabled()
    logits = pipeline.prefill(tiny, cache, _ids(60))
    pipeline.compress(cache)
    with cache.fork() as fork:
        assert pipeline.greedy_decode(tiny, fork, logits, 3, set())
    assert not logits.requires_grad


# --- 6. results files: checked before planning; rows validated ---------------------------------------------


def test_an_unwritable_out_is_refused_before_any_trial(read_only, tmp_path, capsys, no_trials):
    missing = read_only / "new.jsonl"
    assert _cli([*ONE_TRIAL, "--out", str(missing)]) == 2
    assert "cannot be created: nothing can be written in" in capsys.readouterr().err and not missing.exists()


def test_an_existing_unwritable_out_is_refused_before_any_trial(tmp_path, monkeypatch, capsys, no_trials):
    out = tmp_path / "r.jsonl"
    out.write_text("")
    real_os_open = os.open

    def os_open(path, flags, *args, **kwargs):  # the file refuses writing (a read-only mount, another owner)
        if flags & (os.O_WRONLY | os.O_RDWR) and os.path.abspath(path) == str(out):
            raise PermissionError(13, "Permission denied", str(path))
        return real_os_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", os_open)
    assert _cli([*ONE_TRIAL, "--out", str(out)]) == 2
    assert "is not writable (PermissionError: Permission denied)" in capsys.readouterr().err


def test_a_read_only_plot_dir_is_refused_before_any_trial(read_only, tmp_path, capsys, no_trials):
    args = [a for a in ONE_TRIAL if a != "--no-plots"]
    out = tmp_path / "r.jsonl"
    assert _cli([*args, "--out", str(out), "--plot-dir", str(read_only)]) == 2
    assert "--plot-dir" in capsys.readouterr().err and not out.exists()
    assert _cli([*args, "--out", str(out), "--plot-dir", str(read_only / "new" / "plots")]) == 2
    assert "would be made in" in capsys.readouterr().err and not (read_only / "new").exists()


def test_kvzoo_plot_refuses_a_read_only_out_dir(read_only, tmp_path, ok_row, capsys):
    results = tmp_path / "r.jsonl"
    results.write_text(json.dumps(ok_row) + "\n")
    assert _cli(["plot", str(results), "--out-dir", str(read_only)]) == 2
    assert "--out-dir" in capsys.readouterr().err


def test_a_fifo_as_out_is_refused_without_blocking(tmp_path, capsys, no_trials):
    fifo = tmp_path / "r.jsonl"
    os.mkfifo(fifo)
    codes: list[int] = []
    worker = threading.Thread(target=lambda: codes.append(_cli([*ONE_TRIAL, "--out", str(fifo)])), daemon=True)
    worker.start()
    worker.join(120)  # a guard against a hang (a reader blocked on the FIFO), not a timing assertion
    if worker.is_alive():  # unblock the reader: a writer that closes at once
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        worker.join(30)
        pytest.fail("kvzoo leaderboard blocked reading a FIFO given as --out")
    assert codes == [2] and "is not a regular file" in capsys.readouterr().err


def test_a_directory_as_out_is_refused_naming_a_file_to_give(tmp_path, capsys, no_trials):
    assert _cli([*ONE_TRIAL, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "is a directory: give a file path such as" in err and "Traceback" not in err


FOREIGN = [  # another program's JSONL: objects with a "key", and none of them a kvzoo row
    '{"key": "user-17", "value": 3}',
    '{"key": ["a", "b"], "status": "ok", "model": "m", "policy": "full", "task": "vt", "question_position": "after"}',
    '{"key": "k", "status": "ok", "policy": "full", "task": "vt", "question_position": "after", "score": 1}',
    '{"key": "k", "status": "ok", "model": "m", "policy": "full", "task": "vt", "question_position": "after", "score": 1}',
    '{"key": "k", "status": "done", "model": "m", "policy": "full", "task": "vt", "question_position": "after"}',
]


def test_another_programs_jsonl_with_key_fields_is_not_kvzoos(tmp_path, capsys, no_trials):
    path = tmp_path / "other.jsonl"
    path.write_text("\n".join(FOREIGN) + "\n")
    found = runner.read_results_file(path)
    assert found.rows == [] and [line for line, _ in found.bad_lines] == [1, 2, 3, 4, 5]
    whys = [why for _, why in found.bad_lines]
    assert "no 'status', 'model'" in whys[0] and "'key' is list" in whys[1] and "no 'model'" in whys[2]
    assert "without a number for 'answer_nll'" in whys[3] and "status 'done' is not one of ok" in whys[4]
    assert _cli([*ONE_TRIAL, "--out", str(path)]) == 2  # not appended to without --force
    assert "not a kvzoo results file" in capsys.readouterr().err
    assert _cli(["plot", str(path)]) == 2  # no KeyError, no TypeError: reported line by line
    err = capsys.readouterr().err
    assert f"{path}:2: JSON, but not a kvzoo results row" in err and "holds no kvzoo results rows" in err
    assert path.read_text() == "\n".join(FOREIGN) + "\n"


# --- 7. a finished trial stays finished, whatever the order of concatenated rows -----------------------------


@pytest.mark.parametrize("error_first", [False, True])
def test_an_error_row_never_hides_an_ok_row_of_the_same_trial(tmp_path, ok_row, error_first):
    failed = {**ok_row, "status": "error", "error": "RuntimeError: boom", "finished_at": "2000-01-01T00:00:00+00:00"}
    rows = [failed, ok_row] if error_first else [ok_row, failed]
    out = tmp_path / "cat.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ran: list[str] = []
    grid = _grid_from_args(build_parser().parse_args([*ONE_TRIAL, "--out", str(out)]))
    got = runner.run_grid(grid, out, progress=False, on_row=lambda row: ran.append(row["key"]))
    assert ran == [] and len(_lines(out)) == 2  # nothing reran, nothing was written
    assert [r["status"] for r in got] == ["ok"] and got[0]["finished_at"] == ok_row["finished_at"]


# --- 8. two drivers on one --out: the second refuses, naming the first's pid ---------------------------------


def test_a_second_driver_on_the_same_out_refuses_naming_the_first_ones_pid(tmp_path, capsys, no_trials):
    out = tmp_path / "r.jsonl"
    holder = subprocess.Popen(  # the first driver: holds the results file's lock as run_grid does
        [sys.executable, "-c", "import fcntl, os, sys, time\n"
         f"fd = os.open({str(out)!r}, os.O_RDWR | os.O_APPEND | os.O_CREAT)\n"
         "fcntl.flock(fd, fcntl.LOCK_EX)\nprint('locked', flush=True)\ntime.sleep(120)\n"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert _cli([*ONE_TRIAL, "--out", str(out)]) == 2
    finally:
        holder.kill()
        holder.wait()
    err = capsys.readouterr().err
    assert f"is being written by another kvzoo leaderboard (pid {holder.pid})" in err
    assert out.read_text() == ""


def test_the_results_lock_excludes_a_second_holder_in_one_process_too(tmp_path):
    out = tmp_path / "r.jsonl"
    with runner.results_lock(out):
        with pytest.raises(runner.ResultsFileLocked, match=f"pid {os.getpid()}"):
            with runner.results_lock(out):
                pass
    assert not out.exists()  # made for the lock, left empty: removed again
    with runner.results_lock(out):  # released
        pass


# --- 9. inputs are used as given, or refused -------------------------------------------------------------------


def test_float16_asked_for_is_what_the_tiny_model_runs_in(tmp_path):
    model, _ = runner.load("tiny-llama", "float16")
    assert {p.dtype for p in model.parameters()} == {torch.float16}
    reference, _ = runner.load("ref-nope", "bfloat16")
    assert {p.dtype for p in reference.parameters()} == {torch.bfloat16}


def test_continuation_tokens_0_measures_no_delta_ce(tmp_path):
    out = tmp_path / "r.jsonl"
    args = [a if a != "8" else "0" for a in ONE_TRIAL]
    assert main([*args, "--out", str(out)]) == 0
    (row,) = [json.loads(line) for line in _lines(out)]
    assert row["continuation_tokens"] == 0 and row["continuation_ce"] is None and row["delta_ce"] is None
    assert row["settings"]["continuation_tokens"] == 0


def test_a_context_longer_than_the_models_positions_is_an_error_row(tmp_path):
    model = tiny_llama(max_position_embeddings=64)[0]
    with pytest.raises(ValueError, match=r"more than the model's max_position_embeddings \(64\)"):
        pipeline.generate(model, None, list(range(1, 80)), [5], "full", max_new_tokens=2)
    with pytest.raises(ValueError, match=r"max_position_embeddings \(64\)"):
        pipeline.score(model, None, list(range(1, 60)), [5], list(range(1, 10)), "full")
    pipeline.generate(model, None, list(range(1, 60)), [5], "full", max_new_tokens=4)  # 63 positions: fits


# --- 11. kvzoo leaderboard keeps --model when a task option is given --------------------------------------------


@pytest.mark.parametrize("task_option", [["--context-tokens", "500"], ["--depths", "0.5"], ["--seeds", "1"],
                                         ["--tasks", "vt"]])
def test_leaderboard_keeps_the_model_given_with_a_task_option(task_option):
    args = build_parser().parse_args(["leaderboard", "--preset", "demo", "--model", "ref-nope", *task_option])
    grid = _grid_from_args(args)
    assert grid.models == ("ref-nope",)
    assert {t.model for t in runner.plan(grid)} == {"ref-nope"}
