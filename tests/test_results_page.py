"""docs/results.md and README.md's results table are what ``benchmarks/render_results.py`` renders from the committed
results files: a figure cannot be edited by hand, nor drift from the rows that measured it."""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _script():
    spec = importlib.util.spec_from_file_location("render_results", ROOT / "benchmarks" / "render_results.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


render = _script()


@pytest.mark.parametrize("path", sorted(render.expected_files()), ids=lambda p: p.name)
def test_committed_page_is_what_its_data_renders(path: Path):
    expected = render.expected_files()[path]
    assert path.read_text(encoding="utf-8") == expected, (
        f"{path.relative_to(ROOT)} differs from what docs/results/ renders: run `python benchmarks/render_results.py` "
        "and commit the result (change figures by committing the rows that measured them, never by hand)")


def test_every_table_says_its_command_date_and_machine():
    tables = render.read_manifest()
    page = (ROOT / "docs" / "results.md").read_text(encoding="utf-8")
    for entry in tables:
        section = page[page.index(f"## {entry['title']}"):]
        section = section[: section.find("\n## ", 1)] if "\n## " in section[1:] else section
        assert f"Command: `{entry['command']}`" in section, entry["id"]
        assert "Date: 20" in section and "Machine: " in section, entry["id"]
        assert f"docs/results/{entry['file']}" in section


# A program a table's command names: a benchmark script (and its subcommand, a bare word after it), a kvzoo
# subcommand or a make target. The options after it, up to the next program, are its own ("; then --seeds 1" too).
PROGRAM = re.compile(r"(?:python3?|\.venv[\w-]*/bin/python)\s+(?P<script>benchmarks/[\w/]+\.py)"
                     r"(?:\s+(?P<sub>[a-z][a-z0-9-]*)(?=[\s;)]|$))?"
                     r"|(?<![\w./-])kvzoo\s+(?P<kvzoo>[a-z][a-z0-9-]*)"
                     r"|(?<![\w./-])make\s+(?P<make>[a-z][\w-]*)")
OPTION = re.compile(r"(?<![\w-])--[a-z][\w-]*")


@functools.cache
def _script_options(script: str, sub: str | None) -> set[str] | str:
    """The options ``script [sub] --help`` lists in its usage, or why there are none."""
    path = ROOT / script
    if not path.is_file():
        return f"{script} does not exist"
    run = subprocess.run([sys.executable, str(path), *([sub] if sub else []), "--help"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    usage = run.stdout.split("\n\n")[0]
    if run.returncode != 0 or (sub and not usage.startswith(f"usage: {path.name} {sub}")):
        return f"{script} {sub or ''} --help failed: {(run.stderr.strip().splitlines() or ['?'])[-1]}"
    return set(OPTION.findall(usage))


@functools.cache
def _kvzoo_options(sub: str) -> set[str] | str:
    from kvzoo.cli import COMMANDS, build_parser

    if sub not in COMMANDS:
        return f"kvzoo has no subcommand {sub!r}"
    parser = build_parser([sub])
    subparsers = next(a for a in parser._actions if isinstance(a.choices, dict) and sub in a.choices)
    return set(OPTION.findall(subparsers.choices[sub].format_usage()))


def command_problems(command: str) -> list[str]:
    """What a table's command names that does not exist at HEAD: a script, a subcommand, an option, a make target."""
    marks = list(PROGRAM.finditer(command))
    if not marks:
        return [] if "table above" in command else [f"no script, kvzoo or make command in {command!r}"]
    problems = []
    for i, mark in enumerate(marks):
        end = marks[i + 1].start() if i + 1 < len(marks) else len(command)
        if mark["make"]:
            if not re.search(rf"^{re.escape(mark['make'])}\s*:", (ROOT / "Makefile").read_text(), re.M):
                problems.append(f"the Makefile has no target {mark['make']!r}")
            continue
        name = mark["script"] or f"kvzoo {mark['kvzoo']}"
        known = _script_options(mark["script"], mark["sub"]) if mark["script"] else _kvzoo_options(mark["kvzoo"])
        if isinstance(known, str):
            problems.append(known)
            continue
        problems += [f"{name}{' ' + mark['sub'] if mark['sub'] else ''} has no option {option}"
                     for option in OPTION.findall(command, mark.end(), end) if option not in known]
    return problems


def test_every_table_names_a_command_that_runs_at_head():
    """Each table's command names scripts, subcommands, options and make targets that exist (a retired or renamed
    script must take its table's command with it); "the same run as the table above" refers to the one before."""
    tables = render.read_manifest()
    problems = {entry["id"]: command_problems(entry["command"]) for entry in tables}
    assert {table: found for table, found in problems.items() if found} == {}
    assert PROGRAM.search(tables[0]["command"]), "the first table has no table above it to refer to"


def test_the_command_check_names_what_does_not_exist():
    assert command_problems("python benchmarks/no_such_probe.py --json f") == [
        "benchmarks/no_such_probe.py does not exist"]
    assert command_problems("python benchmarks/prefill_peak.py --tokens 4096; then --rounds 2 --no-such-option") == [
        "benchmarks/prefill_peak.py has no option --no-such-option"]
    assert command_problems("python benchmarks/probe.py quest-page --ratios 4 --context-tokens 9") == [
        "benchmarks/probe.py quest-page has no option --context-tokens"]
    assert command_problems("python benchmarks/probe.py no-such-probe")[0].startswith(
        "benchmarks/probe.py no-such-probe --help failed")
    assert command_problems("kvzoo leaderboard --preset demo --no-such-option; kvzoo nothing") == [
        "kvzoo leaderboard has no option --no-such-option", "kvzoo has no subcommand 'nothing'"]
    assert command_problems("make demo") == [] and command_problems("make no-such-target") == [
        "the Makefile has no target 'no-such-target'"]
    assert command_problems("a run of its own") and command_problems("the same run as the table above") == []


def test_the_check_fails_when_a_committed_figure_differs_from_its_data(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch):
    """Change one measured figure in a copy of the data: the rendering changes, so the committed page would fail."""
    copy = tmp_path / "results"
    shutil.copytree(ROOT / "docs" / "results", copy)
    headline = next(t for t in render.read_manifest(copy / "tables.toml") if t.get("headline"))
    path = copy / headline["file"]
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    ok = next(r for r in rows if r["status"] == "ok" and r["policy"] != "full")
    ok["kv_bytes_per_token"] = 3 * (ok["kv_bytes_per_token"] or 1) + 12345
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    before = render.expected_files()
    after = render.expected_files(copy / "tables.toml")
    assert after[render.PAGE] != before[render.PAGE]
    assert after[render.README] != before[render.README]


def test_the_manifest_is_checked(tmp_path: Path):
    bad = tmp_path / "tables.toml"
    bad.write_text('[[table]]\nid = "x"\ntitle = "X"\nfile = "missing.jsonl"\nkind = "leaderboard"\ncommand = "c"\n')
    with pytest.raises(ValueError, match="names missing.jsonl, which is not in"):
        render.read_manifest(bad)
    bad.write_text('[[table]]\nid = "x"\ntitle = "X"\nfile = "tables.toml"\nkind = "pie"\ncommand = "c"\n')
    with pytest.raises(ValueError, match="kind 'pie'; valid: leaderboard"):
        render.read_manifest(bad)


def test_the_readme_headline_block_is_replaced_between_its_markers():
    readme = f"# x\n\n{render.HEADLINE_BEGIN}\nold table\n{render.HEADLINE_END}\n\nrest\n"
    new = render.with_headline(readme, f"{render.HEADLINE_BEGIN}\nnew\n{render.HEADLINE_END}")
    assert new == f"# x\n\n{render.HEADLINE_BEGIN}\nnew\n{render.HEADLINE_END}\n\nrest\n"
    with pytest.raises(ValueError, match="no headline block"):
        render.with_headline("# x\n", "table")


def test_a_plain_table_renders_the_columns_its_entry_names():
    entry = {"id": "t", "command": "c", "date": "2026-12-02", "machine": "m",
             "columns": [["length", "context_tokens"], ["wall", "medians.kvzoo/kvpress.wall", "{:.2f}x"],
                         ["peak", "medians.kvzoo/kvpress.peak", "{:.2f}x"]]}
    rows = [{"context_tokens": 2000, "medians": {"kvzoo/kvpress": {"wall": 0.914, "peak": 0.8}}},
            {"context_tokens": 8000, "medians": {"kvzoo/kvpress": {"wall": 1.2}}}]
    text = render.render_table(entry, rows, Path("x.jsonl"))
    assert "| length | wall | peak |" in text
    assert "| 2000 | 0.91x | 0.80x |" in text and "| 8000 | 1.20x | - |" in text  # a missing value: -
    with pytest.raises(ValueError, match="needs columns"):
        render.render_table({**entry, "columns": None}, rows, Path("x.jsonl"))


def test_pivot_averages_each_cell_says_dash_where_nothing_ran_and_subtracts_the_reference():
    def row(policy, ratio, task, score, position="after"):
        return {"key": f"{policy}|{ratio}|{task}|{position}|{score}", "policy": policy, "ratio": ratio, "task": task,
                "question_position": position, "score": score, "status": "ok"}

    rows = [row("full", None, "a", 0.5), row("full", None, "b", 1.0), row("snapkv", 8, "a", 0.25),
            row("snapkv", 8, "a", 0.75), row("snapkv", 8, "b", 0.0), row("h2o", 8, "b", 1.0),
            row("h2o", 8, "b", 0.0, position="before")]
    entry = {"id": "p", "command": "c", "date": "d", "machine": "m", "rows": [["task", "task"]],
             "column": [["policy", "policy"], ["ratio", "ratio", "{:g}x"]], "value": ["score", "{:.2f}"],
             "where": {"question_position": "after"}}
    text = render.render_pivot(entry, rows, Path("x.jsonl"))
    lines = text.splitlines()
    assert "| task | full | snapkv 8x | h2o 8x |" in lines
    assert "| a | 0.50 (1) | 0.50 (2) | - (0) |" not in lines  # an empty cell carries no count
    assert "| a | 0.50 (1) | 0.50 (2) | - |" in lines and "| b | 1.00 (1) | 0.00 (1) | 1.00 (1) |" in lines
    relative = render.render_pivot({**entry, "relative_to": "full"}, rows, Path("x.jsonl")).splitlines()
    assert "| a | 0.50 (1) | +0.00 (2) | - |" in relative and "| b | 1.00 (1) | -1.00 (1) | +0.00 (1) |" in relative
    blocked = render.render_pivot({**entry, "where": {}, "blocks": [["question", "question_position"]]}, rows,
                                  Path("x.jsonl"))
    assert "**question after**" in blocked and "**question before**" in blocked
    with pytest.raises(ValueError, match="needs 'value'"):
        render.render_pivot({"id": "p", "rows": [], "column": []}, rows, Path("x.jsonl"))


def test_a_table_names_the_versions_its_rows_ran_with():
    rows = [{"versions": {"torch": "2.13.0+cpu", "transformers": "5.24.0"}},
            {"versions": {"torch": "2.13.0+cpu", "transformers": "5.25.0"}}, {"torch": "2.12.0"}]
    line = render.versions_line(rows)
    assert line == "Ran with: torch 2.13.0+cpu / 2.12.0, transformers 5.24.0 / 5.25.0 (from the rows)."
    assert "not recorded" in render.versions_line([{"score": 1.0}])
