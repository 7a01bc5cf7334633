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


pytestmark = pytest.mark.usefixtures("clean_registry")  # tests/conftest.py


def test_list_shows_every_registry_entry(capsys: pytest.CaptureFixture):
    assert main(["list"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if not line.startswith(" ")]
    names = list(registry.available())
    assert [line.split()[0] for line in lines] == names
    for line, (name, summary) in zip(lines, registry.available().items()):
        assert summary in line, name


def test_list_describes_each_default_retriever_from_its_configuration(capsys: pytest.CaptureFixture):
    assert main(["list"]) == 0
    out = capsys.readouterr().out.splitlines()
    retrievers = {out[i - 1].split()[0]: line.strip() for i, line in enumerate(out) if line.strip().startswith("retriever:")}
    assert set(retrievers) == {"quest", "vestige"}  # the two policies whose defaults retrieve
    vestige = registry.build_retriever(registry.get("vestige", ratio=4).retriever)
    # what runs by default: int8 keys on GQA rows, the sketch on MLA rows, top-j by the estimate
    assert (vestige.index, vestige.rank_by) == ("auto", "estimate")
    assert "int8 keys on GQA rows, the low-rank sketch on MLA rows" in retrievers["vestige"]
    assert f"top-{vestige.j} rows per query head, ranked by the bound's estimate" in retrievers["vestige"]
    assert "certified" not in retrievers["vestige"]
    # a configuration says what it is: the certified mode, by the bound
    from kvzoo.cli import describe_retriever

    certified = registry.build_retriever("vestige", certified=True, tau=4.0, index="sketch")
    assert "index 'sketch'" in describe_retriever(certified) and "within tau=4.0" in describe_retriever(certified)


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
        (["leaderboard", "--model", "gpt-5"], "valid names are smollm2-135m, gemma3-270m, tiny-llama"),
        (["leaderboard", "--ratios", "0.5"], "a ratio is a number >= 1"),
        (["leaderboard", "--depths", "50"], "a depth is a fraction in [0, 1]"),
        (["leaderboard", "--positions", "during"], "choose from after, before"),
        (["leaderboard", "--preset", "huge"], "choose from demo, leaderboard, leaderboard-hour, long, tiny"),
        (["run", "--policy", "snapkvv"], "Available policies: full, streaming_llm"),
        # a library error in the command line's words: the flag, not the Python keyword
        (["run", "--policy", "snapkv", "--model", "tiny-llama"], "needs a budget: pass --ratio (e.g. --ratio 4 keeps"),
        (["run", "--policy", "snapkv", "--ratio", "4", "--budget", "8"], "give either --ratio or --budget, not both"),
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
    assert "rows     : of " in out and "(mean of 3 layers)" in out


def test_run_keeps_its_default_needle_and_options(capsys: pytest.CaptureFixture):
    code = main(["run", "--model", "tiny-llama", "--policy", "streaming_llm", "--ratio", "4", "--context-tokens", "300",
                 "--depth", "0.5", "--max-new-tokens", "2", "--question-position", "before", "--chunk-size", "128"])
    assert code == 0
    out = capsys.readouterr().out
    assert "question : What is the special magic number for Lisbon?" in out
    assert "expected : 7381924" in out  # the default needle's answer, and the answer scored against it
    assert any(line.startswith("score    : ") and "string_match_all" in line for line in out.splitlines())
    assert "question before compression" in out
    # one summary: every layer holds its rows alike, so no per-layer table
    assert "layers   : all 3 hold their rows alike (--per-layer prints the table)" in out
    assert "  layer   seen" not in out


def _summary_lines(out: str) -> dict[str, str]:
    return {line[:9].strip(): line[11:] for line in out.splitlines() if line[9:11] == ": "}


def test_run_prints_one_summary_and_the_layer_table_on_request(capsys: pytest.CaptureFixture):
    args = ["run", "--model", "tiny-llama", "--policy", "vestige", "--ratio", "4", "--context-tokens", "400",
            "--max-new-tokens", "3"]
    assert main(args) == 0
    summary = _summary_lines(capsys.readouterr().out)
    assert list(summary) == ["policy", "context", "question", "answer", "expected", "score", "time", "rows", "fetched", "KV bytes",
                             "counters", "layers"]
    assert "e+" not in "".join(summary.values())  # counts and MiB, never raw floats
    assert summary["time"].startswith("prefill ") and "decode steps" in summary["time"]
    assert "per decode step per layer and KV group" in summary["fetched"] and "in 3 of 3 layers" in summary["fetched"]
    assert " MiB (" in summary["KV bytes"] and "KiB/token" in summary["KV bytes"]
    assert "rows_scanned " in summary["counters"] and "index_bytes_scanned" not in summary["counters"]
    assert summary["layers"].startswith("all 3 hold their rows alike")

    assert main([*args, "--per-layer"]) == 0
    lines = capsys.readouterr().out.splitlines()
    head = lines.index("  layer   seen  kept  archived  dropped  events  fetched  resident KiB  read MiB")
    assert [line.split()[0] for line in lines[head + 1:]] == ["0", "1", "2"]


def test_run_prints_the_layer_table_when_layers_differ(capsys: pytest.CaptureFixture):
    # quest keeps its first two layers dense (dense_layers=2): those hold every row, layer 2 archives
    assert main(["run", "--model", "tiny-llama", "--policy", "quest", "--ratio", "4", "--context-tokens", "300",
                 "--max-new-tokens", "2"]) == 0
    out = capsys.readouterr().out
    assert "layers   : they hold their rows differently" in out
    table = out.split("resident KiB  read MiB\n")[1].splitlines()
    assert [int(line.split()[2]) == int(line.split()[1]) for line in table] == [True, True, False]  # kept == seen


def test_run_summary_counts_rows_per_kv_group_and_shares_of_the_rows_seen():
    from kvzoo.cli import run_summary
    from kvzoo.framework.stats import CacheStats, LayerStats
    from kvzoo.pipeline import GenerationResult

    def layer(i: int) -> LayerStats:
        # 2 KV groups, 100-byte rows, 1000 rows seen: 250 kept, 750 archived; the last step fetched 40 rows in all
        last = {"attended_bytes_read": 2 * 250 * 100, "index_bytes_scanned": 2 * 2**20, "rows_fetched": 40,
                "fetched_bytes": 4000, "kv_bytes_read": 2 * 250 * 100 + 2 * 2**20 + 4000}
        return LayerStats(layer=i, seen_rows=1000, resident_rows=250, peak_resident_rows=300, resident_bytes=2**20,
                          archived_bytes=3 * 2**20, archived_rows=750, dropped_rows=0, events=1, fetched_rows=400,
                          kv_bytes_read=5 * 2**20, policy_info={"retrieval_steps": 10, "index_bytes_scanned": 265142000},
                          last_step=last)

    stats = CacheStats(policy={"name": "p"}, layers=[layer(0), layer(1)])
    result = GenerationResult(answer="", token_ids=[1, 2, 3, 4, 5], stats=stats, context_tokens=990,
                              timings={"prefill_s": 1.0, "compress_s": 0.5, "question_s": 0.25, "decode_s": 0.2},
                              question_tokens=5, cache=None)
    summary = _summary_lines(run_summary(result))
    assert summary["time"] == "prefill 1.00 s, compress 0.50 s, question 0.25 s, decode 0.20 s (4 decode steps, 50.0 ms/step)"
    assert summary["rows"] == ("of 1000 seen per layer and KV group (mean of 2 layers): kept 250 (25.0 %), "
                               "archived 750 (75.0 %), dropped 0 (0.0 %); 2 compression events")
    assert summary["fetched"] == ("20.0 archived rows per decode step per layer and KV group (2.0 % of the rows seen), "
                                  "in 2 of 2 layers")
    assert summary["KV bytes"] == ("resident 2.00 MiB (2.05 KiB/token), archived 6.00 MiB (6.14 KiB/token); "
                                   "read 4.10 MiB per decode step (attended 0.10, index 4.00, fetched 0.01), 10.00 MiB in all")
    assert summary["counters"] == "retrieval_steps 20"
    assert summary["layers"] == "all 2 hold their rows alike (--per-layer prints the table)"


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


def test_demo_resumes_unless_fresh(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    import json

    import kvzoo.cli
    import kvzoo.demo

    monkeypatch.chdir(tmp_path)
    seen: list[list[str]] = []
    monkeypatch.setattr(kvzoo.cli, "main", lambda argv: seen.append(argv) or 0)
    assert kvzoo.demo.main([]) == 0
    assert not (tmp_path / "results").exists()  # no leaderboard ran, so no results folder and no run record
    (tmp_path / "results").mkdir()
    assert kvzoo.demo.main(["--resume", "--policies", "full"]) == 0
    assert kvzoo.demo.main(["--fresh"]) == 0
    assert seen == [["leaderboard", "--preset", "demo"],
                    ["leaderboard", "--preset", "demo", "--policies", "full"],
                    ["leaderboard", "--preset", "demo", "--fresh"]]
    record = json.loads((tmp_path / "results" / "demo.run.json").read_text())  # what the results page reads
    assert record["command"] == "python -m kvzoo.demo --fresh"
    assert record["wall_s"] >= 0 and record["exit_code"] == 0 and record["cpu_count"] >= 1


def test_demo_interrupted_by_sigint_keeps_its_trials_and_resumes(tmp_path: Path):
    """Ctrl-C (SIGINT) after a few trials of a toy demo: one line, exit 130, no run record or plots of an earlier run;
    the same command then keeps the finished rows and completes the grid."""
    import json
    import os
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "demo.jsonl"
    for stale in ("demo.run.json", "demo-frontier.png"):  # an earlier, finished run's record and plot
        (tmp_path / stale).write_text("{}")
    command = [sys.executable, "-m", "kvzoo.demo", "--preset", "tiny", "--policies", "full", "streaming_llm",
               "snapkv", "h2o", "--ratios", "2", "4", "8", "--context-tokens", "200", "--positions", "after",
               "--max-new-tokens", "2", "--no-progress", "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    first = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and first.poll() is None:
        if out.is_file() and len(out.read_text().splitlines()) >= 2:
            break
        time.sleep(0.05)
    assert first.poll() is None, first.communicate()
    first.send_signal(signal.SIGINT)
    _, err = first.communicate(timeout=60)
    assert first.returncode == 130, err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("kvzoo leaderboard: interrupted; ") and " of 10 trials are kept in " in last, last
    assert last.endswith("the same command resumes where it stopped")
    assert not (tmp_path / "demo.run.json").exists() and not (tmp_path / "demo-frontier.png").exists()
    kept = [json.loads(line) for line in out.read_text().splitlines()]
    assert 2 <= len(kept) < 10

    second = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert second.returncode == 0, second.stderr
    assert f"resuming: {len(kept)} of 10 trials finished in {out} are kept" in second.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows[:len(kept)] == kept and len(rows) == 10  # the finished rows kept as they were, each trial once
    assert json.loads((tmp_path / "demo.run.json").read_text())["exit_code"] == 0


def test_demo_starts_over_when_its_rows_ran_with_other_versions(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture):
    import types

    import kvzoo.bench.results as results
    import kvzoo.cli
    import kvzoo.demo

    out = tmp_path / "demo.jsonl"
    out.write_text("")
    now = {"kvzoo": "1", "kvpress": "not installed", "torch": "2.13.0", "transformers": "5.25.0", "python": "3.11"}
    monkeypatch.setattr(results, "versions", lambda: now)
    rows = [{"versions": {**now, "transformers": "5.24.0"}}, {"versions": now}]
    monkeypatch.setattr(results, "read_results_file", lambda path: types.SimpleNamespace(rows=rows))
    assert kvzoo.demo.other_versions(out) == "transformers 5.24.0 (now 5.25.0)"
    seen: list[list[str]] = []
    monkeypatch.setattr(kvzoo.cli, "main", lambda argv: seen.append(argv) or 0)
    assert kvzoo.demo.main(["--out", str(out)]) == 0
    assert seen[-1][-1] == "--fresh"
    assert "ran with transformers 5.24.0 (now 5.25.0): starting over" in capsys.readouterr().err
    rows[0] = {"versions": now}
    assert kvzoo.demo.other_versions(out) is None
    assert kvzoo.demo.main(["--out", str(out)]) == 0
    assert "--fresh" not in seen[-1] and "resuming from" in capsys.readouterr().err
