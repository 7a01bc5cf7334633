"""docs/results.md and README.md's results table are what ``benchmarks/render_results.py`` renders from the committed
results files: a figure cannot be edited by hand, nor drift from the rows that measured it."""

from __future__ import annotations

import importlib.util
import json
import shutil
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
