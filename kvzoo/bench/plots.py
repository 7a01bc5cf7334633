"""PNG figures from results rows: the needle heatmap (depth × context length) and score-vs-ratio curves.

Both read the runner's rows (successful trials with the question at ``position``), average the
string-match score over everything else (seeds, tasks), and write with matplotlib's Agg backend
(no display needed).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvzoo.bench.report import REFERENCE_POLICY, policy_order, ratio_order


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def needle_heatmap(rows: Sequence[dict[str, Any]], path: str | Path, *, position: str = "after") -> Path:
    """One panel per (ratio, policy): mean score by needle depth (rows) and context length (columns).

    Plots one task on one haystack: ``niah_single`` (else the first needle task) on the haystack
    with the most trials, so every cell averages the same kind of trial (over seeds).
    """
    plt = _pyplot()
    ok = [r for r in rows if r["status"] == "ok" and r.get("depth") is not None and r["question_position"] == position]
    if not ok:
        raise ValueError(f"no successful needle trials with the question {position} compression to plot")
    # one task on one haystack, so a cell is one kind of trial: the single needle on its most-run haystack
    single = [r for r in ok if r["task"] == "niah_single"] or ok
    counts: dict[tuple[str, str], int] = {}
    for r in single:
        counts[(r["task"], r["haystack"])] = counts.get((r["task"], r["haystack"]), 0) + 1
    task, haystack = max(counts, key=lambda k: (counts[k], k == ("niah_single", "essay")))
    ok = [r for r in single if (r["task"], r["haystack"]) == (task, haystack)]
    depths = sorted({r["depth"] for r in ok})
    lengths = sorted({r["context_tokens"] for r in ok})
    policies = policy_order(ok)
    ratios: list[float | None] = list(ratio_order(ok)) or [None]
    fig, axes = plt.subplots(
        len(ratios), len(policies), squeeze=False, sharex=True, sharey=True, layout="constrained",
        figsize=(1.5 + 1.5 * len(policies) * max(1.0, 0.6 * len(lengths)), 1.0 + len(ratios) * (1.0 + 0.35 * len(depths))),
    )
    image = None
    for i, ratio in enumerate(ratios):
        for j, policy in enumerate(policies):
            ax = axes[i][j]
            mine = [r for r in ok if r["policy"] == policy and (r.get("ratio") is None or r.get("ratio") == ratio)]
            grid = [[_mean([r["score"] for r in mine if r["depth"] == d and r["context_tokens"] == n]) for n in lengths]
                    for d in depths]
            image = ax.imshow(grid, vmin=0.0, vmax=1.0, cmap="RdYlGn", aspect="auto")
            for y, line in enumerate(grid):
                for x, value in enumerate(line):
                    if value == value:  # not NaN
                        ax.text(x, y, f"{value:.2f}", ha="center", va="center", fontsize=7)
            ax.set_xticks(range(len(lengths)), [str(n) for n in lengths], fontsize=7)
            ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths], fontsize=7)
            ax.tick_params(labelsize=7)
            ratio_text = "" if policy == REFERENCE_POLICY or ratio is None else f" {ratio:g}x"
            ax.set_title(f"{policy}{ratio_text}", fontsize=8)
            if i == len(ratios) - 1:
                ax.set_xlabel("context tokens", fontsize=7)
            if j == 0:
                ax.set_ylabel("needle depth", fontsize=7)
    fig.suptitle(f"{task} score on {haystack} text, question {position} compression", fontsize=9)
    if image is not None:
        fig.colorbar(image, ax=axes, shrink=0.8, label="score")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def score_vs_ratio(rows: Sequence[dict[str, Any]], path: str | Path, *, position: str = "after") -> Path:
    """Mean score and needle intact rate against the compression ratio, one line per policy."""
    plt = _pyplot()
    ok = [r for r in rows if r["status"] == "ok" and r["question_position"] == position]
    if not ok:
        raise ValueError(f"no successful trials with the question {position} compression to plot")
    ratios = ratio_order(ok)
    fig, (ax_score, ax_intact) = plt.subplots(1, 2, figsize=(10, 4))
    for policy in policy_order(ok):
        mine = [r for r in ok if r["policy"] == policy]
        for ax, key in ((ax_score, "score"), (ax_intact, "intact")):
            if all(r.get("ratio") is None for r in mine):  # the reference: a horizontal line
                value = _mean([float(r[key]) for r in mine if r.get(key) is not None])
                ax.axhline(value, linestyle="--", color="gray", label=policy)
                continue
            xs = [x for x in ratios if any(r.get("ratio") == x for r in mine)]
            ys = [_mean([float(r[key]) for r in mine if r.get("ratio") == x and r.get(key) is not None]) for x in xs]
            ax.plot(xs, ys, marker="o", label=policy)
    for ax, label in ((ax_score, "string-match score"), (ax_intact, "needle intact rate (ΔNLL < 1 nat)")):
        ax.set_xscale("log", base=2)
        if ratios:
            ax.set_xticks(ratios, [f"{x:g}x" for x in ratios])
        ax.set_ylim(-0.05, 1.05)
        ax.set_xlabel("compression ratio")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    ax_score.legend(fontsize=8)
    fig.suptitle(f"question {position} compression", fontsize=9)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_plots(rows: Sequence[dict[str, Any]], out_dir: str | Path, prefix: str = "", *,
                position: str = "after") -> list[Path]:
    """Both figures into ``out_dir`` (``{prefix}needle-heatmap.png``, ``{prefix}score-vs-ratio.png``); the paths written."""
    out_dir = Path(out_dir)
    written = [score_vs_ratio(rows, out_dir / f"{prefix}score-vs-ratio.png", position=position)]
    if any(r.get("depth") is not None and r["status"] == "ok" for r in rows):
        written.insert(0, needle_heatmap(rows, out_dir / f"{prefix}needle-heatmap.png", position=position))
    return written
