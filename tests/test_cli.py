"""The ``kvzoo`` command: list, run, leaderboard, plot; errors that name what is valid."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvzoo import registry
from kvzoo.cli import main

TINY_LEADERBOARD = [
    "leaderboard", "--preset", "tiny", "--policies", "full", "streaming_llm", "--context-tokens", "300",
    "--positions", "after", "before", "--max-new-tokens", "3", "--no-progress",
]


@pytest.fixture(autouse=True)
def clean_registry():
    registry.reset()
    yield
    registry.reset()


def test_list_shows_every_registry_entry(capsys: pytest.CaptureFixture):
    assert main(["list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    names = list(registry.available())
    assert [line.split()[0] for line in lines] == names
    for line, (name, summary) in zip(lines, registry.available().items()):
        assert summary in line, name


def test_list_verbose_shows_parameters(capsys: pytest.CaptureFixture):
    assert main(["list", "--verbose"]) == 0
    out = capsys.readouterr().out
    assert "parameters: ratio=None" in out and "sinks=4" in out and "from: built-in plugin" in out


def test_installed_command_runs_from_any_directory(tmp_path: Path):
    script = shutil.which("kvzoo", path=str(Path(sys.executable).parent))
    assert script, "the kvzoo console script is not installed next to this Python (pip install -e .)"
    done = subprocess.run([script, "list"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    for name in registry.available():
        assert name in done.stdout


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["leaderboard", "--tasks", "needle"], "invalid choice: 'needle' (choose from niah_single"),
        (["leaderboard", "--policies", "snapkvv"], "registered policies: full, streaming_llm, snapkv"),
        (["leaderboard", "--model", "gpt-5"], "valid names are smollm2-135m, tiny-llama"),
        (["leaderboard", "--ratios", "0.5"], "a ratio is a number >= 1"),
        (["leaderboard", "--depths", "50"], "a depth is a fraction in [0, 1]"),
        (["leaderboard", "--positions", "during"], "choose from after, before"),
        (["leaderboard", "--preset", "huge"], "choose from demo, leaderboard, tiny"),
        (["run", "--policy", "snapkvv"], "Available policies: full, streaming_llm"),
        (["run", "--policy", "snapkv", "--ratio", "4", "--model", "gpt-5"], "valid names are smollm2-135m"),
        (["run", "--task", "niah_single", "--haystack", "poetry"], "choose from noise, book, essay"),
        (["plot", "no/such/results.jsonl"], "no results file 'no/such/results.jsonl'"),
        (["bench"], "choose from list, run, leaderboard, plot"),
    ],
)
def test_bad_arguments_name_what_is_valid(argv: list[str], message: str, capsys: pytest.CaptureFixture):
    try:
        code = main(argv)
    except SystemExit as exit_:
        code = exit_.code
    assert code == 2
    err = " ".join(capsys.readouterr().err.split()).replace("'", "")
    assert " ".join(message.split()).replace("'", "") in err


def test_run_a_task_on_a_tiny_model(capsys: pytest.CaptureFixture):
    code = main(["run", "--model", "tiny-llama", "--task", "niah_multikey", "--context-tokens", "500",
                 "--policy", "snapkv", "--ratio", "2", "--max-new-tokens", "3"])
    assert code == 0
    out = capsys.readouterr().out
    assert "task     : niah_multikey/essay/500/d0.35/s0" in out
    assert "score    : 0.00 (string_match_all" in out or "score    : 1.00 (string_match_all" in out
    assert "policy snapkv: 3 layers" in out


def test_run_keeps_its_default_needle_and_options(capsys: pytest.CaptureFixture):
    code = main(["run", "--model", "tiny-llama", "--policy", "streaming_llm", "--ratio", "4", "--context-tokens", "300",
                 "--depth", "0.5", "--max-new-tokens", "2", "--question-position", "before", "--chunk-size", "128"])
    assert code == 0
    out = capsys.readouterr().out
    assert "question : What is the special magic number for Lisbon?" in out
    assert "question before compression" in out


def test_leaderboard_prints_the_table_and_writes_plots_then_plot_redraws(tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture):
    results = tmp_path / "lb.jsonl"
    assert main([*TINY_LEADERBOARD, "--out", str(results)]) == 0
    out = capsys.readouterr().out
    assert "| policy | 2x q after | 2x q before | 2x KV bytes/token |" in out
    assert "| full (reference) | " in out and "| streaming_llm | " in out
    heatmap = tmp_path / "lb-needle-heatmap.png"
    curves = tmp_path / "lb-score-vs-ratio.png"
    assert heatmap.stat().st_size > 0 and curves.stat().st_size > 0
    assert len(results.read_text().splitlines()) == 4  # 2 policies x after/before

    heatmap.unlink()
    assert main(["plot", str(results), "--out-dir", str(tmp_path / "again")]) == 0
    assert (tmp_path / "again" / "lb-needle-heatmap.png").stat().st_size > 0

    # rerunning resumes: nothing left to run, the same table
    assert main([*TINY_LEADERBOARD, "--out", str(results), "--no-plots"]) == 0
    assert "| streaming_llm | " in capsys.readouterr().out
    assert len(results.read_text().splitlines()) == 4


def test_demo_runs_the_demo_preset_afresh_unless_resuming(monkeypatch: pytest.MonkeyPatch):
    import kvzoo.cli
    import kvzoo.demo

    seen: list[list[str]] = []
    monkeypatch.setattr(kvzoo.cli, "main", lambda argv: seen.append(argv) or 0)
    assert kvzoo.demo.main([]) == 0
    assert kvzoo.demo.main(["--resume", "--policies", "full"]) == 0
    assert seen == [["leaderboard", "--preset", "demo", "--fresh"],
                    ["leaderboard", "--preset", "demo", "--policies", "full"]]
