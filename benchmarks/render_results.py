"""Render the results page (docs/results.md) and README.md's headline table from the committed results files.

    python benchmarks/render_results.py           # rewrite docs/results.md, docs/frontier.png, README's headline block
    python benchmarks/render_results.py --check   # write nothing; exit 1 naming what differs (tests/test_results_page.py)

The tables are listed in ``docs/results/tables.toml``, in page order. Each names its results file under
``docs/results/`` (JSONL rows, or a JSON list of rows), how to render it (``kind``), the command that produced it,
and -- where the rows do not record them -- the date and the machine. A figure on the page is never typed: it is
computed here from the file, so editing a figure means committing the rows that measured it. To publish a new run of
``make demo``: ``cp results/demo.jsonl results/demo.run.json docs/results/`` and run this script.

Kinds:

* ``leaderboard``: rows of ``kvzoo leaderboard`` (``make demo``): the leaderboard and detail tables of
  ``kvzoo.bench.report``; date and machine from the rows (``finished_at``, ``versions``), the wall time and load from
  the run record ``<file stem>.run.json`` that ``python -m kvzoo.demo`` writes beside its rows. ``headline = true``
  also renders README.md's one table (between its ``kvzoo:headline`` markers) and the quality-cost frontier PNG.
* ``length_grid``: rows of ``kvzoo leaderboard`` over several tasks and context lengths (the ``long`` preset):
  ``full``'s score per task and length and the longest length where it answers >= 0.8 (the one a comparison reads),
  then per ``fields = [[field, format, heading], ...]`` (default the score) a table of (policy, ratio) lines by (task,
  length) columns, then the detail table; ``where`` keeps some rows.
* ``decode_step``: rows of ``benchmarks/decode_step.py --json``: time and bytes of one decode step per arm, and the
  parts of a step when it ran with ``--profile``.
* ``step_ops``: the JSON of ``benchmarks/decode_step.py --ops --json``: ops one decode step launches, per cache.
* ``table``: any rows, one table line each, the columns named in the entry: ``columns = [[header, field, format],
  ...]``, ``field`` a key or a dotted path into the row (``medians.kvzoo/kvpress.wall``), ``format`` a format
  string (``"{:.2f}x"``; ``"{}"`` when omitted); a missing value renders as ``-``.

This script needs the standard library and kvzoo's report module only (no torch): CI renders the page in a second.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvzoo.bench import report  # noqa: E402
from kvzoo.bench.results import latest_rows  # noqa: E402

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: tomli is kvzoo's dependency there
    import tomli as tomllib

RESULTS = ROOT / "docs" / "results"
MANIFEST = RESULTS / "tables.toml"
PAGE = ROOT / "docs" / "results.md"
README = ROOT / "README.md"
FRONTIER = ROOT / "docs" / "frontier.png"
HEADLINE_BEGIN = "<!-- kvzoo:headline begin: written by `python benchmarks/render_results.py` from docs/results/ -->"
HEADLINE_END = "<!-- kvzoo:headline end -->"
REQUIRED = ("id", "title", "file", "kind", "command")


# --- reading -------------------------------------------------------------------------------------


def read_manifest(path: Path = MANIFEST) -> list[dict[str, Any]]:
    """The ``[[table]]`` entries of the manifest, checked: each names a results file that exists and a known kind."""
    with path.open("rb") as fh:
        tables = tomllib.load(fh).get("table", [])
    if not tables:
        raise ValueError(f"{path} lists no [[table]]")
    for entry in tables:
        missing = [key for key in REQUIRED if not entry.get(key)]
        if missing:
            raise ValueError(f"{path}: table {entry.get('id', '?')!r} needs {', '.join(missing)}")
        if entry["kind"] not in KINDS:
            raise ValueError(f"{path}: table {entry['id']!r} has kind {entry['kind']!r}; valid: {', '.join(KINDS)}")
        if not (path.parent / entry["file"]).is_file():
            raise ValueError(f"{path}: table {entry['id']!r} names {entry['file']}, which is not in {path.parent}")
    if sum(bool(t.get("headline")) for t in tables) > 1:
        raise ValueError(f"{path}: one table at most is the README's headline")
    return tables


def read_rows(path: Path) -> list[dict[str, Any]]:
    """Rows of a JSONL file (one object a line) or of a JSON file holding a list of objects."""
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json":
        rows = json.loads(text)
        if not isinstance(rows, list):
            raise ValueError(f"{path}: a JSON results file holds a list of rows")
        return rows
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def run_record(path: Path) -> dict[str, Any] | None:
    """The run record written beside a results file (``demo.jsonl`` -> ``demo.run.json``), if any."""
    record = path.with_name(path.stem + ".run.json")
    return json.loads(record.read_text(encoding="utf-8")) if record.is_file() else None


# --- the parts every table carries ---------------------------------------------------------------


def _provenance(entry: dict[str, Any], date: str | None, machine: str | None, extra: str = "") -> str:
    date = date or entry.get("date")
    machine = machine or entry.get("machine")
    if not date or not machine:
        raise ValueError(f"table {entry['id']!r}: its rows do not record the {'date' if not date else 'machine'}; "
                         "give it in docs/results/tables.toml")
    lines = [f"Command: `{entry['command']}`  ", f"Date: {date}  ", f"Machine: {machine}" + ("  " if extra else "")]
    if extra:
        lines.append(extra)
    return "\n".join(lines)


def _leaderboard_provenance(rows: list[dict[str, Any]]) -> tuple[str | None, str | None]:
    dates = sorted(r["finished_at"] for r in rows if r.get("finished_at"))
    date = None
    if dates:
        first, last = dates[0][:10], dates[-1][:10]
        date = first if first == last else f"{first} to {last}"
    versions = next((r["versions"] for r in rows if r.get("versions")), None)
    machine = None
    if versions:
        machine = (f"{versions.get('platform', '?')}, {versions.get('cpu_count', '?')} CPUs; "
                   f"torch {versions.get('torch', '?')} ({versions.get('torch_threads', '?')} threads), transformers "
                   f"{versions.get('transformers', '?')}, kvzoo {versions.get('kvzoo', '?')}")
    return date, machine


def _run_line(record: dict[str, Any] | None, rows: list[dict[str, Any]]) -> str:
    """The measured wall time, from the run record, or the trials' own times when there is none."""
    trials = [r for r in rows if r.get("trial_seconds") is not None]
    busy = sum(r["trial_seconds"] for r in trials)
    load = sum(r.get("model_load_s") or 0 for r in rows)
    if record is None:
        return f"Trials: {len(rows)}, {busy:.0f} s of trials and {load:.0f} s of model loading (no run record)."
    start, end = record.get("load_average_start"), record.get("load_average_end")
    load_text = "" if start is None else f"; load average {start:.1f} at the start" + (
        f", {end:.1f} at the end" if end is not None else "")
    return (f"Wall time: **{record['wall_s']:.0f} s** for {len(rows)} trials (the whole command: start-up, model "
            f"loading {load:.0f} s, trials {busy:.0f} s, plots){load_text}.")


# --- kinds -------------------------------------------------------------------------------------


def render_leaderboard(entry: dict[str, Any], rows: list[dict[str, Any]], path: Path) -> str:
    date, machine = _leaderboard_provenance(rows)
    latest = list({r["key"]: r for r in rows}.values())  # the latest row of each trial, as the leaderboard reads
    parts = [_provenance(entry, date, machine, _run_line(run_record(path), latest)), "", report.caption(latest), "",
             report.leaderboard_table(latest), "", report.detail_table(latest)]
    issues = report.problems(latest)
    if issues:
        parts += ["", "Skipped or failed:", *[f"- {line}" for line in issues]]
    return "\n".join(parts)


def render_length_grid(entry: dict[str, Any], rows: list[dict[str, Any]], path: Path) -> str:
    """A grid over tasks and context lengths (the ``long`` preset): ``full``'s curve and the length each task's
    comparison reads, then one table per ``fields`` entry ([field, format, heading]): per (policy, ratio) line, the
    mean per (task, length) column; then the detail table."""
    date, machine = _leaderboard_provenance(rows)
    latest = _where(entry, list({r["key"]: r for r in rows}.values()))
    parts = [_provenance(entry, date, machine, _run_line(run_record(path), latest)), "", report.caption(latest), "",
             f"Full cache by task and length (a comparison reads the longest length where it answers >= "
             f"{report.FULL_ENOUGH:g}):", "", report.full_curve(latest)]
    for field, fmt, heading in entry.get("fields", [["score", ".2f", "Score"]]):
        parts += ["", f"{heading}:", "", report.length_table(latest, field, fmt)]
    parts += ["", report.detail_table(latest)]
    issues = report.problems(latest)
    if issues:
        parts += ["", "Skipped or failed:", *[f"- {line}" for line in issues]]
    return "\n".join(parts)


def headline_table(entry: dict[str, Any], rows: list[dict[str, Any]], path: Path) -> str:
    """README's table: per policy and ratio, the score, the needle intact rate and the KV bytes read per token."""
    latest = [r for r in {r["key"]: r for r in rows}.values() if r["status"] == "ok"
              and r["question_position"] == "after"]
    ratios = report.ratio_order(latest)
    columns = ["policy"] + [f"{r:g}x {what}" for r in ratios for what in ("score", "intact", "KV read/token")]
    lines = ["| " + " | ".join(columns) + " |", "|---|" + "---:|" * (len(columns) - 1)]
    for policy in report.policy_order(latest):
        mine = [r for r in latest if r["policy"] == policy]
        cells = [policy + (" (reference)" if policy == report.REFERENCE_POLICY else "")]
        for ratio in ratios:
            cell = [r for r in mine if r.get("ratio") is None or float(r["ratio"]) == ratio]
            if not cell:
                cells += ["n/a"] * 3
                continue
            intact = [r["intact"] for r in cell if r.get("intact") is not None]
            cells += [f"{_mean([r['score'] for r in cell]):.2f}",
                      f"{sum(intact) / len(intact):.2f}" if intact else "n/a",
                      report.format_bytes(_mean([r.get("kv_bytes_per_token") for r in cell]))]
        lines.append("| " + " | ".join(cells) + " |")
    date, _ = _leaderboard_provenance(rows)
    return "\n".join([
        f"`{entry['command']}` ({date}; {report.caption(latest)}). Score: RULER string match of the greedy "
        "answer; intact: the needle's teacher-forced ΔNLL < 1 nat against `full`; KV read/token: the KV-path bytes "
        "(attended rows, index entries, fetched rows) read per generated token. The machine, the time and the detail: "
        "[docs/results.md](docs/results.md).",
        "",
        *lines,
    ])


def _mean(values: list[Any]) -> float | None:
    values = [float(v) for v in values if v is not None]
    return sum(values) / len(values) if values else None


def render_decode_step(entry: dict[str, Any], rows: list[dict[str, Any]], path: Path) -> str:
    torch = sorted({r.get("torch") for r in rows if r.get("torch")})
    omp = sorted({r.get("omp_wait_policy") for r in rows if r.get("omp_wait_policy")})
    context = sorted({r.get("context") for r in rows if r.get("context")})
    steps = sorted({r.get("steps") for r in rows if r.get("steps")})
    machine = entry.get("machine", "")
    if torch:
        machine += f"; torch {', '.join(torch)}"
    read = next((r.get("read_gb_s") for r in rows if r.get("read_gb_s")), None)
    extra = (f"Context {', '.join(map(str, context))} tokens, {', '.join(map(str, steps))} interleaved rounds, "
             f"OMP_WAIT_POLICY={', '.join(omp) or '?'}" + (f"; the machine read {read:.1f} GB/s" if read else "") + ".")
    base = rows[0]
    wall = all(r.get("wall_ms_2t") for r in rows)  # a 1-thread-only run (--threads 1) has no wall column
    bound = all(r.get("bound_mib_per_step") for r in rows)  # weights and untiered layers stated (since issue 45)
    head = "| arm | CPU ms/step (1 thread) | vs " + base["arm"]
    head += (" | wall ms/step (2 threads) | vs " + base["arm"]) if wall else ""
    head += " | KV MiB read/step | index MiB/step"
    head += " | untiered MiB/step | weights MiB | bytes vs " + base["arm"] if bound else ""
    lines = [head + " |", "|---|" + "---:|" * (head.count("|") - 1)]
    for r in rows:
        kv = "n/a" if r.get("kv_mib_per_step") is None else f"{r['kv_mib_per_step']:.1f}"
        cells = [r["arm"], f"{r['cpu_ms_1t']:.1f}", f"{r['cpu_ms_1t'] / base['cpu_ms_1t']:.2f}x"]
        if wall:
            cells += [f"{r['wall_ms_2t']:.1f}", f"{r['wall_ms_2t'] / base['wall_ms_2t']:.2f}x"]
        cells += [kv, f"{r.get('index_mib_per_step') or 0:.2f}"]
        if bound:
            cells += [f"{r['untiered_mib_per_step']:.1f}", f"{r['weights_mib']:.0f}",
                      f"{r['bound_mib_per_step'] / base['bound_mib_per_step']:.2f}x"]
        lines.append("| " + " | ".join(cells) + " |")
    parts = [_provenance(entry, None, machine, extra), "", *lines]
    profiled = [r for r in rows if r.get("profile")]
    if profiled:
        names = list(dict.fromkeys(name for r in profiled for name in r["profile"]))
        parts += ["", "Where a step's CPU time goes (ms, 1 thread, `--profile`):", "",
                  "| arm | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
        for r in profiled:
            parts.append(f"| {r['arm']} | " + " | ".join(
                f"{r['profile'][n]:.1f}" if n in r["profile"] else "" for n in names) + " |")
    return "\n".join(parts)


def render_step_ops(entry: dict[str, Any], rows: list[dict[str, Any]], path: Path) -> str:
    models = list(dict.fromkeys(r["model"] for r in rows))
    caches = list(dict.fromkeys((r["cache"], r.get("capacity")) for r in rows))
    head = ["cache"] + models
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * len(models)]
    for cache, capacity in caches:
        label = cache + (", capacity" if capacity else "")
        cells = []
        for model in models:
            row = next((r for r in rows if r["model"] == model and r["cache"] == cache and r.get("capacity") == capacity),
                       None)
            if row is None:
                cells.append("")
            elif "error" in row:
                cells.append("n/a")
            else:
                beyond = row.get("beyond StaticCache")
                cells.append(f"{row['launches']}" + (f" ({beyond:+.1f})" if beyond is not None else "")
                             + (f", {row['syncs']} syncs" if row.get("syncs") else ""))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    note = ("A cell: ops that launch work in one steady decode step (metadata ops apart), and in brackets the "
            "launches per attention layer beyond transformers' `StaticCache`; host syncs where there are any.")
    return "\n".join([_provenance(entry, None, None), "", note, "", *lines])


def _field(row: dict[str, Any], path: str) -> Any:
    value: Any = row
    for key in path.split("."):
        if not isinstance(value, dict) or key not in value:
            return None
        value = value[key]
    return value


def _where(entry: dict[str, Any], rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows whose fields equal the values of ``entry``'s ``where`` (or one of them, for a list)."""
    return [r for r in rows if all(_field(r, k) in (v if isinstance(v, list) else [v])
                                   for k, v in entry.get("where", {}).items())]


def render_table(entry: dict[str, Any], rows: list[dict[str, Any]], path: Path) -> str:
    rows = _where(entry, rows)
    columns = entry.get("columns")
    if not columns or any(not isinstance(c, list) or len(c) not in (2, 3) for c in columns):
        raise ValueError(f"table {entry['id']!r} (kind table) needs columns = [[header, field, format], ...]")
    lines = ["| " + " | ".join(c[0] for c in columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        cells = []
        for column in columns:
            value = _field(row, column[1])
            cells.append("-" if value is None else (column[2] if len(column) == 3 else "{}").format(value))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join([_provenance(entry, None, None), "", *lines])


def _parts(row: dict[str, Any], spec: list[list[str]]) -> tuple[str, ...]:
    """``row``'s values of ``spec``'s fields ([header, field] or [header, field, format]), formatted; "" for none."""
    return tuple("" if (v := _field(row, c[1])) is None else (c[2] if len(c) == 3 else "{}").format(v) for c in spec)


def render_pivot(entry: dict[str, Any], rows: list[dict[str, Any]], path: Path) -> str:
    """A cross table: one line per distinct ``rows`` key, one column per distinct ``column`` key (in first-seen order),
    each cell the mean of ``value`` over the rows it holds ("-": no row ran there) with, where rows differ in count,
    the count; one table per distinct ``blocks`` key. A column whose fields are all null (``full``'s ratio) is headed
    ``column_none`` (default "none"). ``where`` keeps the rows whose fields equal its values (or one of them, for a list).
    ``relative_to`` (a policy name): every other column's cell is its mean less the mean of that policy's rows of the
    same line and block (the reference's own column stays absolute)."""
    for key in ("rows", "column", "value"):
        if key not in entry:
            raise ValueError(f"table {entry['id']!r} (kind pivot) needs {key!r}: rows = [[header, field, format], ...], "
                             "column = [[header, field, format], ...], value = [field, format]")
    if "key" in (rows[0] if rows else {}):
        rows = list(latest_rows(rows).values())  # one row per trial, as the leaderboard reads
    rows = _where(entry, rows)
    field, fmt = entry["value"][0], entry["value"][1] if len(entry["value"]) > 1 else "{}"
    reference = entry.get("relative_to")
    blocks = entry.get("blocks", [])
    parts = [_provenance(entry, *_leaderboard_provenance(rows)), ""]
    for block in dict.fromkeys(_parts(r, blocks) for r in rows):
        mine = [r for r in rows if _parts(r, blocks) == block]
        cells_of: dict[tuple, dict[tuple, list[dict[str, Any]]]] = {}  # line key -> column key -> its rows
        for r in mine:
            cells_of.setdefault(_parts(r, entry["rows"]), {}).setdefault(_parts(r, entry["column"]), []).append(r)
        column_keys = list(dict.fromkeys(ck for line in cells_of.values() for ck in line))
        if blocks:
            parts += ["**" + ", ".join(f"{c[0]} {v}".strip() for c, v in zip(blocks, block, strict=True) if v) + "**", ""]
        header = [c[0] for c in entry["rows"]] + [" ".join(p for p in key if p) or entry.get("column_none", "none")
                                                for key in column_keys]
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(entry["rows"]) + "---:|" * len(column_keys)]
        counts = {len(held) for line in cells_of.values() for held in line.values()}
        for line_key, line in cells_of.items():
            base = _mean([_field(r, field) for held in line.values() for r in held
                          if reference and r.get("policy") == reference])
            cells = list(line_key)
            for column_key in column_keys:
                held = line.get(column_key, [])
                mean = _mean([_field(r, field) for r in held])
                if mean is None:
                    cells.append("-")
                    continue
                if reference is None or any(r.get("policy") == reference for r in held):
                    text = fmt.format(mean)
                elif base is None:
                    text = fmt.format(mean) + " (no reference)"
                else:
                    text = entry.get("relative_format", "{:+.2f}").format(mean - base)
                cells.append(text + (f" ({len(held)})" if len(counts) > 1 else ""))
            lines.append("| " + " | ".join(cells) + " |")
        parts += [*lines, ""]
    return "\n".join(parts).rstrip()


KINDS: dict[str, Callable[[dict[str, Any], list[dict[str, Any]], Path], str]] = {
    "leaderboard": render_leaderboard,
    "length_grid": render_length_grid,
    "decode_step": render_decode_step,
    "step_ops": render_step_ops,
    "table": render_table,
    "pivot": render_pivot,
}


# --- the page --------------------------------------------------------------------------------------


def render_page(tables: list[dict[str, Any]], results: Path = RESULTS) -> str:
    out = ["# Results", "",
           "<!-- Generated by `python benchmarks/render_results.py` from the files in docs/results/ (listed in "
           "docs/results/tables.toml). Do not edit: change the data, run the script; tests/test_results_page.py fails "
           "when this page and its data disagree. -->", "",
           "Every table below is computed from a committed results file, and says the command that produced it, "
           "when, and on what machine. Absolute times vary several-fold between machines and loads; compare arms "
           "within one table. What each column means: [evaluation.md](evaluation.md) and "
           "[benchmarks/README.md](../benchmarks/README.md). Figures measured before these files existed are listed, "
           "dated, in [CHANGELOG.md](../CHANGELOG.md).", ""]
    out.append("Contents: " + ", ".join(f"[{t['title']}](#{_anchor(t['title'])})" for t in tables))
    out.append("")
    for entry in tables:
        path = results / entry["file"]
        rows = read_rows(path)
        out += [f"## {entry['title']}", ""]
        if entry.get("about"):
            out += [entry["about"].strip(), ""]
        out += [KINDS[entry["kind"]](entry, rows, path), ""]
        if entry.get("headline"):
            out += [f"![quality against KV bytes read per token]({FRONTIER.relative_to(PAGE.parent).as_posix()})", ""]
        if entry.get("notes"):
            out += [entry["notes"].strip(), ""]
        out += [versions_line(rows), "", f"Data: [`docs/results/{entry['file']}`](results/{entry['file']})", ""]
    return "\n".join(out).rstrip() + "\n"


VERSIONED = ("torch", "transformers", "kvpress", "python")


def versions_line(rows: list[dict[str, Any]]) -> str:
    """The versions the rows ran with (each row's ``versions``, or a bare ``torch``), every distinct value listed: a
    table is re-rendered when the locks change its figures, and says which locks made it."""
    seen: dict[str, list[str]] = {}
    for row in rows:
        versions = row.get("versions") if isinstance(row.get("versions"), dict) else {}
        for name in VERSIONED:
            value = versions.get(name, row.get(name) if name == "torch" else None)
            if value is not None and str(value) not in seen.setdefault(name, []):
                seen[name].append(str(value))
    listed = [f"{name} {' / '.join(values)}" for name, values in seen.items() if values]
    if not listed:
        return "Ran with: versions not recorded in these rows (they predate the versions field)."
    return "Ran with: " + ", ".join(listed) + " (from the rows)."


def _anchor(title: str) -> str:
    """GitHub's heading anchor: lower case, punctuation dropped, spaces to hyphens."""
    kept = "".join(c for c in title.lower() if c.isalnum() or c in " -_")
    return kept.replace(" ", "-")


def headline_block(tables: list[dict[str, Any]], results: Path = RESULTS) -> str | None:
    entry = next((t for t in tables if t.get("headline")), None)
    if entry is None:
        return None
    path = results / entry["file"]
    rows = read_rows(path)
    return "\n".join([HEADLINE_BEGIN, headline_table(entry, rows, path), "", versions_line(rows), HEADLINE_END])


def with_headline(readme: str, block: str) -> str:
    """``readme`` with its headline block replaced by ``block`` (a ValueError when the markers are missing)."""
    start, end = readme.find(HEADLINE_BEGIN), readme.find(HEADLINE_END)
    if start < 0 or end < start:
        raise ValueError(f"README.md has no headline block: put the two marker lines\n{HEADLINE_BEGIN}\n{HEADLINE_END}\n"
                         "where the table goes")
    return readme[:start] + block + readme[end + len(HEADLINE_END):]


def expected_files(manifest: Path = MANIFEST) -> dict[Path, str]:
    """What the page and README.md should hold, rendered from the committed data."""
    tables = read_manifest(manifest)
    files = {PAGE: render_page(tables, manifest.parent)}
    block = headline_block(tables, manifest.parent)
    if block is not None:
        files[README] = with_headline(README.read_text(encoding="utf-8"), block)
    return files


def write_frontier(manifest: Path = MANIFEST) -> Path | None:
    """The headline table's quality-cost frontier as docs/frontier.png (matplotlib: not compared by --check)."""
    from kvzoo.bench import plots

    entry = next((t for t in read_manifest(manifest) if t.get("headline")), None)
    if entry is None:
        return None
    rows = list({r["key"]: r for r in read_rows(manifest.parent / entry["file"])}.values())
    return plots.frontier(rows, FRONTIER)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 when a file differs")
    args = parser.parse_args(argv)
    stale = []
    for path, text in expected_files().items():
        if not path.is_file() or path.read_text(encoding="utf-8") != text:
            stale.append(path)
            if not args.check:
                path.write_text(text, encoding="utf-8")
    if args.check:
        for path in stale:
            print(f"{path.relative_to(ROOT)} differs from what docs/results/ renders: run "
                  "`python benchmarks/render_results.py` and commit it", file=sys.stderr)
        return 1 if stale else 0
    written = write_frontier()
    for path in stale:
        print(f"wrote {path.relative_to(ROOT)}")
    if written is not None:
        print(f"wrote {written.relative_to(ROOT)}")
    print(f"rendered at {datetime.datetime.now().isoformat(timespec='seconds')}: {len(stale)} file(s) changed")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
