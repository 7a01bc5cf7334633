"""Markdown tables from results rows: the leaderboard (one row per policy, ``full`` first; per ratio the mean score
with the question after and before compression, and the KV-path bytes per generated token; ``benchmarks/README.md``)
and the detail table (one row per policy and ratio: intact rate, ΔNLL, ΔCE, memory, fetched rows, times).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

REFERENCE_POLICY = "full"


def format_bytes(n: float | None) -> str:
    """``1536`` -> ``1.5 KiB``; None -> ``n/a``."""
    if n is None or (isinstance(n, float) and math.isnan(n)):
        return "n/a"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def _mean(values: Iterable[float | None]) -> float | None:
    vals = [float(v) for v in values if v is not None]
    return sum(vals) / len(vals) if vals else None


def _fmt(value: float | None, spec: str = ".2f", signed: bool = False) -> str:
    if value is None:
        return "n/a"
    return f"{value:+{spec}}" if signed else f"{value:{spec}}"


def _ratio_label(ratio: float | None) -> str:
    return "—" if ratio is None else f"{ratio:g}x"


def policy_order(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The reference first, then policies in the order they first appear (the runner's plan order)."""
    names: list[str] = []
    for row in rows:
        if row["policy"] not in names:
            names.append(row["policy"])
    return sorted(names, key=lambda n: (n != REFERENCE_POLICY, names.index(n)))


def ratio_order(rows: Sequence[dict[str, Any]]) -> list[float]:
    return sorted({float(r["ratio"]) for r in rows if r.get("ratio") is not None})


def _cell_rows(rows: Sequence[dict[str, Any]], policy: str, ratio: float | None) -> list[dict[str, Any]]:
    """Rows of one (policy, ratio); for a policy run without a ratio, its rows whatever ``ratio`` is."""
    mine = [r for r in rows if r["policy"] == policy]
    if mine and all(r.get("ratio") is None for r in mine):
        return mine
    return [r for r in mine if r.get("ratio") is not None and float(r["ratio"]) == ratio]


def _status(cell: list[dict[str, Any]]) -> str | None:
    """None if some trial succeeded, else ``skipped``/``error``/``n/a``."""
    if any(r["status"] == "ok" for r in cell):
        return None
    if any(r["status"] == "error" for r in cell):
        return "error"
    return "skipped" if cell else "n/a"


def caption(rows: Sequence[dict[str, Any]]) -> str:
    """One line saying what the table averages over."""
    ok = [r for r in rows if r["status"] == "ok"] or list(rows)
    if not ok:
        return "no trials"

    def values(key: str) -> str:
        seen: list[str] = []
        for r in ok:
            v = r.get(key)
            text = "-" if v is None else (f"{v:g}" if isinstance(v, float) else str(v))
            if text not in seen:
                seen.append(text)
        return ", ".join(seen)

    tasks = sorted({f"{r['task']} ({r['haystack']})" for r in ok})
    return (
        f"model {values('model')}; tasks {', '.join(tasks)}; context {values('context_tokens')} tokens; "
        f"depths {values('depth')}; seeds {values('seed')}; question {values('question_position')} compression"
    )


def leaderboard_table(rows: Sequence[dict[str, Any]], ratios: Sequence[float] | None = None) -> str:
    """The markdown leaderboard: rows policies, per ratio q after | q before | KV bytes/token."""
    ratios = list(ratios) if ratios is not None else ratio_order(rows)
    columns = ["policy"]
    for ratio in ratios:
        label = _ratio_label(ratio)
        columns += [f"{label} q after", f"{label} q before", f"{label} KV bytes/token"]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for policy in policy_order(rows):
        cells = [policy + (" (reference)" if policy == REFERENCE_POLICY else "")]
        for ratio in ratios:
            cell = _cell_rows(rows, policy, ratio)
            status = _status(cell)
            if status is not None:
                cells += [status, "", ""]
                continue
            ok = [r for r in cell if r["status"] == "ok"]
            after = [r for r in ok if r["question_position"] == "after"]
            before = [r for r in ok if r["question_position"] == "before"]
            score_after = _mean(r["score"] for r in after)
            score_before = _mean(r["score"] for r in before)
            bytes_token = _mean(r.get("kv_bytes_per_token", r.get("kv_bytes_per_step")) for r in (after or ok))
            cells += [_fmt(score_after), _fmt(score_before), format_bytes(bytes_token)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def detail_table(rows: Sequence[dict[str, Any]]) -> str:
    """One row per (policy, ratio): intact rate, ΔNLL, ΔCE, memory and time figures (successful trials). The
    "ΔCE (one forward)" column shows only when a row measured it (``Grid.one_forward``)."""
    one_forward = any(r.get("delta_ce_one_forward") is not None for r in rows)
    columns = [
        "policy", "ratio", "trials", "intact rate", "mean ΔNLL (nats)", "ΔCE (nats/token)",
        *(["ΔCE (one forward)"] if one_forward else []),
        "resident KV",
        "KV freed", "fetched rows/step", "bound violations", "prefill+compress (s)", "decode (ms/step)",
    ]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for policy in policy_order(rows):
        mine = [r for r in rows if r["policy"] == policy and r["status"] == "ok"]
        for ratio in sorted({r.get("ratio") for r in mine}, key=lambda x: -1.0 if x is None else x):
            cell = [r for r in mine if r.get("ratio") == ratio]
            intact = [r["intact"] for r in cell if r.get("intact") is not None]
            violations = [r["bound_violations"] for r in cell if r.get("bound_violations") is not None]
            lines.append("| " + " | ".join([
                policy,
                _ratio_label(ratio),
                str(len(cell)),
                _fmt(sum(intact) / len(intact) if intact else None),
                _fmt(_mean(r.get("delta_nll") for r in cell), signed=True),
                _fmt(_mean(r.get("delta_ce") for r in cell), ".4f", signed=True),
                *([_fmt(_mean(r.get("delta_ce_one_forward") for r in cell), ".4f", signed=True)] if one_forward else []),
                format_bytes(_mean(r.get("resident_bytes") for r in cell)),
                format_bytes(_mean(r.get("bytes_freed") for r in cell)),
                _fmt(_mean(r.get("fetched_rows_per_step") for r in cell), ".1f"),
                str(sum(violations)) if violations else "n/a",
                _fmt(_mean((r.get("prefill_s") or 0) + (r.get("compress_s") or 0) for r in cell)),
                _fmt(_mean(r.get("decode_ms_per_step") for r in cell), ".0f"),
            ]) + " |")
    return "\n".join(lines)


FULL_ENOUGH = 0.8  # where `full` answers below this, a length is too hard for the model to compare policies on


def _groups(rows: Sequence[dict[str, Any]]) -> list[tuple[str, int]]:
    """The (task, context length) pairs of ``rows``, tasks in first-seen order, lengths ascending."""
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    return sorted({(r["task"], r["context_tokens"]) for r in rows}, key=lambda g: (tasks.index(g[0]), g[1]))


def comparison_lengths(rows: Sequence[dict[str, Any]], threshold: float = FULL_ENOUGH) -> dict[str, int | None]:
    """Per task, the longest context length at which ``full`` answers at least ``threshold`` of its trials (None:
    at none): the length a comparison of policies reads -- past it, a miss is the model's, not the cache's."""
    out: dict[str, int | None] = {}
    for task, length in _groups(rows):
        score = _mean(r["score"] for r in rows if r["status"] == "ok" and r["policy"] == REFERENCE_POLICY
                      and r["task"] == task and r["context_tokens"] == length)
        out.setdefault(task, None)
        if score is not None and score >= threshold:
            out[task] = length
    return out


def full_curve(rows: Sequence[dict[str, Any]], threshold: float = FULL_ENOUGH) -> str:
    """One line per task: ``full``'s score at each length (trials in brackets), and the length compared."""
    lines = []
    compared = comparison_lengths(rows, threshold)
    for task in dict.fromkeys(t for t, _ in _groups(rows)):
        points = []
        for _, length in [g for g in _groups(rows) if g[0] == task]:
            mine = [r["score"] for r in rows if r["status"] == "ok" and r["policy"] == REFERENCE_POLICY
                    and r["task"] == task and r["context_tokens"] == length]
            points.append(f"{_fmt(_mean(mine))} at {length} ({len(mine)})" if mine else f"n/a at {length}")
        chosen = compared[task]
        verdict = (f"compare at {chosen} tokens" if chosen is not None
                   else f"full answers below {threshold:g} at every length: no comparison")
        lines.append(f"- {task}: full {', '.join(points)} -> {verdict}")
    return "\n".join(lines)


def length_table(rows: Sequence[dict[str, Any]], field: str = "score", spec: str = ".2f",
                 threshold: float = FULL_ENOUGH) -> str:
    """One line per (policy, ratio), one column per (task, context length): the mean of ``field`` over the ok trials
    (their count in brackets where cells differ); a column where ``full`` answers below ``threshold`` is marked. A
    configured variant (``vestige(ratio=64)``) shows the ratio its configuration holds."""
    ok = [r for r in rows if r["status"] == "ok"]
    groups = _groups(ok)
    full_at = {g: _mean(r["score"] for r in ok if r["policy"] == REFERENCE_POLICY
                        and (r["task"], r["context_tokens"]) == g) for g in groups}
    header = ["policy", "ratio"] + [f"{t} {n}" + (f" (full < {threshold:g})" if full_at[(t, n)] is not None
                                                   and full_at[(t, n)] < threshold else "") for t, n in groups]
    cells_of: dict[tuple[str, float | None], dict[tuple[str, int], list[float]]] = {}
    for r in ok:
        if r.get(field) is None:
            continue
        ratio = r.get("ratio") if r.get("ratio") is not None else (r.get("policy_config") or {}).get("ratio")
        cells_of.setdefault((r["policy"], ratio), {}).setdefault((r["task"], r["context_tokens"]), []).append(r[field])
    counts = {len(v) for line in cells_of.values() for v in line.values()}
    lines = ["| " + " | ".join(header) + " |", "|---|---|" + "---:|" * len(groups)]
    order = policy_order(ok)
    for policy, ratio in sorted(cells_of, key=lambda k: (order.index(k[0]), -1.0 if k[1] is None else k[1])):
        line = cells_of[(policy, ratio)]
        cells = [policy, _ratio_label(ratio)]
        for g in groups:
            held = line.get(g)
            cells.append("-" if not held else _fmt(_mean(held), spec) + (f" ({len(held)})" if len(counts) > 1 else ""))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def problems(rows: Sequence[dict[str, Any]]) -> list[str]:
    """``policy ratio: status: error`` for each distinct skipped or failed cell."""
    seen: dict[tuple[str, str, str], str] = {}
    for r in rows:
        if r["status"] != "ok":
            seen.setdefault((r["policy"], _ratio_label(r.get("ratio")), r["status"]), r.get("error") or "")
    return [f"{policy} {ratio}: {status}: {error}" for (policy, ratio, status), error in seen.items()]


def trial_label(row: dict[str, Any]) -> str:
    ratio = "" if row.get("ratio") is None else f" {row['ratio']:g}x"
    depth = "" if row.get("depth") is None else f" d={row['depth']:g}"
    return f"{row['policy']}{ratio} {row.get('task', '?')}{depth} q-{row.get('question_position', '?')}"


def worker_table(rows: Sequence[dict[str, Any]]) -> str:
    """Which worker ran what: one row per ``worker`` (``host:pid``; ``(not recorded)`` for rows older than the field,
    ``(lost)`` for trials that lost every worker) -- trials, retried ones, busy time, its longest trial, peak memory."""
    by_worker: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        name = "(not recorded)" if "worker" not in row else row["worker"] or "(lost)"
        by_worker.setdefault(name, []).append(row)
    lines = ["| worker | trials | retried here | busy s | mean s/trial | longest trial | peak memory |",
             "|---|---:|---:|---:|---:|---|---:|"]
    for name, mine in sorted(by_worker.items()):
        timed = [r for r in mine if r.get("trial_seconds") is not None]
        busy = sum(r["trial_seconds"] for r in timed)
        longest = max(timed, key=lambda r: r["trial_seconds"], default=None)
        retried = sum(1 for r in mine if (r.get("attempts") or 1) > 1)
        peak = max((r.get("peak_rss_bytes") or 0 for r in mine), default=0)
        lines.append(
            f"| {name} | {len(mine)} | {retried} | {busy:.1f} | {_fmt(busy / len(timed) if timed else None)} | "
            + (f"{trial_label(longest)} ({longest['trial_seconds']:.1f} s)" if longest else "n/a")
            + f" | {format_bytes(peak) if peak else 'n/a'} |"
        )
    return "\n".join(lines)


def render(rows: Sequence[dict[str, Any]], *, title: str = "kvzoo leaderboard", detail: bool = True) -> str:
    """Caption, leaderboard table, detail table and the list of skipped/failed cells, per model."""
    out: list[str] = []
    models = list(dict.fromkeys(r["model"] for r in rows))
    for model in models:
        mine = [r for r in rows if r["model"] == model]
        out += [f"## {title}: {model}", "", caption(mine), "", leaderboard_table(mine), ""]
        if len(_groups([r for r in mine if r["status"] == "ok"])) > 1:  # several tasks or lengths: each apart
            out += [f"Full cache by task and length (a comparison reads the longest length where it answers >= "
                    f"{FULL_ENOUGH:g}):", "", full_curve(mine), "", "Score by task and length:", "", length_table(mine), ""]
        if detail:
            out += [detail_table(mine), ""]
        issues = problems(mine)
        if issues:
            out += ["Skipped or failed:", *[f"- {line}" for line in issues], ""]
        peak = max((r.get("peak_rss_bytes") or 0 for r in mine), default=0)
        if peak:
            out.append(f"Peak process memory (VmHWM, a process-wide high-water mark): {format_bytes(peak)}.")
            out.append("")
    return "\n".join(out).rstrip() + "\n"
