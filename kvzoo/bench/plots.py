"""PNG figures from results rows: the needle heatmap (depth × context length), score-vs-ratio curves, and the
quality-cost frontier (score and intact rate against the KV bytes read per generated token), each averaged over the
successful trials with the question at ``position`` (matplotlib's Agg backend: no display needed).
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


def _save(fig: Any, path: str | Path, **savefig: Any) -> Path:
    """Write ``fig`` as a PNG at ``path`` (its folder made) and close it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, **savefig)
    _pyplot().close(fig)
    return path


def _tie_offset(k: int, members: int) -> float:
    """The vertical offset of the ``k``-th of ``members`` points of equal value: spread by up to :data:`TIE_SPREAD`."""
    return (k - (members - 1) / 2) * min(0.02, TIE_SPREAD / (members - 1)) if members > 1 else 0.0


def needle_heatmap(rows: Sequence[dict[str, Any]], path: str | Path, *, position: str = "after") -> Path:
    """:func:`needle_heatmap_figure` as a PNG at ``path``."""
    return _save(needle_heatmap_figure(rows, position=position), path)


def needle_heatmap_figure(rows: Sequence[dict[str, Any]], *, position: str = "after") -> Any:
    """One panel per (ratio, policy): mean score by needle depth (rows) and context length (columns), for one task on
    one haystack (``niah_single`` on its most-run haystack) so every cell averages the same kind of trial."""
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
    if image is not None:
        fig.colorbar(image, ax=axes, shrink=0.8, label="score")
    _fit_suptitle(fig, f"{task} score on {haystack} text, question {position} compression", fontsize=9)
    return fig


def _fit_suptitle(fig: Any, text: str, **style: Any) -> Any:
    """``fig.suptitle(text)``, broken at its commas and then at spaces onto as few lines as fit the figure's width: a
    heatmap of one or two policies is about 3 in wide, and its one-line title was cut off at both sides."""
    import textwrap

    title = fig.suptitle(text, **style)
    renderer = fig.canvas.get_renderer()
    width = fig.bbox.width * 0.96
    clauses = text.replace(", ", ",\n").split("\n")
    tries = ["\n".join(clauses)] + ["\n".join(line for clause in clauses
                                             for line in textwrap.wrap(clause, chars, break_long_words=False))
                                   for chars in range(max(map(len, clauses)) - 1, 0, -1)]
    for wrapped in tries:
        if title.get_window_extent(renderer).width <= width:
            break
        title.set_text(wrapped)
    return title


# Each policy its own marker, so lines that coincide still show which policies they are; the star is the reference's.
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "<", ">", "h", "p")
# matplotlib's tab10: with 11 markers, (colour, marker) pairs repeat only after 110 policies
COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")
REFERENCE_STYLE = {"color": "black", "marker": "*"}


def policy_styles(rows: Sequence[dict[str, Any]]) -> dict[str, dict[str, str]]:
    """The one table of each policy's ``color`` and ``marker``, for every figure drawn from ``rows``: the reference
    black with a star, the others in :func:`~kvzoo.bench.report.policy_order` (the plan's), so a policy looks the same
    in the score-vs-ratio curves and on the frontier (each used to count its own)."""
    styles: dict[str, dict[str, str]] = {}
    for policy in policy_order(rows):
        if policy == REFERENCE_POLICY:
            styles[policy] = dict(REFERENCE_STYLE)
        else:
            i = len([p for p in styles if p != REFERENCE_POLICY])
            styles[policy] = {"color": COLORS[i % len(COLORS)], "marker": MARKERS[i % len(MARKERS)]}
    return styles


# Where a label may go, in points from its marker's centre: beside it (right first), then further out; a label that
# finds no place beside its own marker (nearer it than any other, clear of markers, labels and lines) goes further
# out with a leader line to its marker.
_DIRECTIONS = ((1, 0), (1, 1), (1, -1), (0, 1), (0, -1), (-1, 0), (-1, 1), (-1, -1))
_BESIDE = (5.0, 9.0)
_LEADER = (16.0, 24.0, 34.0, 46.0)


def _marker_boxes(ax: Any) -> list[tuple[Any, Any]]:
    """Each marker drawn in ``ax``: its centre (display units) and its box."""
    from matplotlib.transforms import Bbox

    scale = ax.figure.dpi / 72
    found = []
    for line in ax.get_lines():
        if line.get_marker() in (None, "None", "", " ") or not line.get_visible():
            continue
        half = line.get_markersize() * scale / 2
        xy = line.get_transform().transform(line.get_xydata())
        found += [((x, y), Bbox.from_extents(x - half, y - half, x + half, y + half)) for x, y in xy]
    return found


def _label_box(point: tuple[float, float], offset: tuple[float, float], size: tuple[float, float],
               scale: float) -> Any:
    """The box of a ``size`` (display units) label whose anchor is ``offset`` points from ``point`` (display units),
    aligned away from the point (see :func:`_alignment`)."""
    from matplotlib.transforms import Bbox

    (w, h), (dx, dy) = size, offset
    x, y = point[0] + dx * scale, point[1] + dy * scale
    ha, va = _alignment(offset)
    x0 = {"left": x, "right": x - w, "center": x - w / 2}[ha]
    y0 = {"bottom": y, "top": y - h, "center": y - h / 2}[va]
    return Bbox.from_bounds(x0, y0, w, h)


def _alignment(offset: tuple[float, float]) -> tuple[str, str]:
    dx, dy = offset
    return ("left" if dx > 0 else "right" if dx < 0 else "center"), ("bottom" if dy > 0 else "top" if dy < 0 else "center")


def _distance(box: Any, point: tuple[float, float]) -> float:
    """From the centre of ``box`` to ``point`` (display units)."""
    return float(((box.x0 + box.x1) / 2 - point[0]) ** 2 + ((box.y0 + box.y1) / 2 - point[1]) ** 2) ** 0.5


def _place_labels(fig: Any, labels: list[tuple[Any, str, tuple[float, float], dict[str, Any]]]) -> None:
    """Annotate each ``(axes, text, (x, y) in data units, text style)`` beside its marker where it is unambiguous:
    nearer its own marker than any other, over no marker, label or line, inside the axes; where no offset beside it
    is all that, further out with a leader line to it; else at the offset that breaks the fewest of these. Labels
    used to be drawn over each other, and beside another policy's marker where markers crowd. The layout is fixed
    first, so what is measured is what is saved."""
    if not labels:
        return
    import math

    from matplotlib.path import Path

    fig.canvas.draw()
    fig.set_layout_engine("none")
    renderer = fig.canvas.get_renderer()
    scale = fig.dpi / 72
    markers = {ax: _marker_boxes(ax) for ax in {ax for ax, *_ in labels}}
    paths = {ax: [line.get_transform().transform_path(line.get_path()) for line in ax.get_lines()
                  if line.get_linestyle() not in ("None", "none", "", " ") and line.get_visible()] for ax in markers}
    placed: dict[Any, list[Any]] = {ax: [] for ax in markers}
    for ax, text, xy, style in labels:
        point = tuple(ax.transData.transform(xy))
        probe = ax.text(0, 0, text, **style)
        extent = probe.get_window_extent(renderer)
        probe.remove()
        size = (extent.width, extent.height)
        area = ax.get_window_extent(renderer)
        others = [centre for centre, _ in markers[ax] if math.dist(centre, point) > 0.5]

        def cost(box: Any, leader: bool, ax: Any = ax, point: tuple = point, area: Any = area,
                 others: list = others) -> float:
            padded = box.padded(1.5)
            broken = 1000 * sum(padded.overlaps(other) for other in placed[ax])
            broken += 100 * sum(padded.overlaps(marker) for _, marker in markers[ax])
            broken += 30 * sum(path.intersects_bbox(padded, filled=False) for path in paths[ax])
            broken += 200 * (not (area.x0 <= box.x0 and box.x1 <= area.x1 and area.y0 <= box.y0 and box.y1 <= area.y1))
            if leader:  # a leader line says whose label it is, if it passes over no other marker
                centre = ((box.x0 + box.x1) / 2, (box.y0 + box.y1) / 2)
                segment = Path([point, centre])
                broken += 100 * sum(segment.intersects_bbox(marker, filled=False) for c, marker in markers[ax]
                                    if math.dist(c, point) > 0.5)
            else:  # beside, only nearness does
                broken += 300 * any(_distance(box, centre) <= _distance(box, point) for centre in others)
            return broken

        tries = [(cost(_label_box(point, (r * dx, r * dy), size, scale), False), (r * dx, r * dy), False)
                 for r in _BESIDE for dx, dy in _DIRECTIONS]
        best = min(tries, key=lambda t: t[0])
        if best[0] > 0:
            leaders = [(cost(_label_box(point, (r * dx, r * dy), size, scale), True) + 1, (r * dx, r * dy), True)
                       for r in _LEADER for dx, dy in _DIRECTIONS]
            best = min([best, *leaders], key=lambda t: t[0])
        _, offset, leader = best
        ha, va = _alignment(offset)
        arrow = {"arrowprops": {"arrowstyle": "-", "color": style.get("color", "black"), "linewidth": 0.6,
                                "shrinkA": 1, "shrinkB": 4}} if leader else {}
        ax.annotate(text, xy, xytext=offset, textcoords="offset points", ha=ha, va=va, **style, **arrow)
        placed[ax].append(_label_box(point, offset, size, scale))


# Points of equal value at one ratio are spread vertically by at most this much in all (axis units: scores
# and rates are in [0, 1]); the labels at the lines' right ends name every policy of a group that ties there.
TIE_SPREAD = 0.08


def _spread(values: dict[str, float]) -> dict[str, float]:
    """Drawn heights for one ratio: policies with equal values are offset around it, in policy order; others stay."""
    groups: dict[float, list[str]] = {}
    for policy, value in values.items():
        if value == value:  # not NaN
            groups.setdefault(round(value, 9), []).append(policy)
    drawn = dict(values)
    for members in groups.values():
        if len(members) > 1:
            for k, policy in enumerate(members):
                drawn[policy] = values[policy] + _tie_offset(k, len(members))
    return drawn


def score_vs_ratio_figure(rows: Sequence[dict[str, Any]], *, position: str = "after") -> Any:
    """Mean score and needle intact rate against the compression ratio (:func:`write_plots` saves it): one line per
    policy, each its own marker; equal points at a ratio are offset (the legend says so) and labelled at the last
    ratio, so coinciding lines stay apart."""
    plt = _pyplot()
    ok = [r for r in rows if r["status"] == "ok" and r["question_position"] == position]
    if not ok:
        raise ValueError(f"no successful trials with the question {position} compression to plot")
    ratios = ratio_order(ok)
    policies = policy_order(ok)
    styles = policy_styles(rows)
    fig, (ax_score, ax_intact) = plt.subplots(1, 2, figsize=(12, 4.2), layout="constrained")
    spread_any = False
    for ax, key in ((ax_score, "score"), (ax_intact, "intact")):
        means: dict[str, dict[float, float]] = {}
        for policy in policies:
            mine = [r for r in ok if r["policy"] == policy]
            if all(r.get("ratio") is None for r in mine):  # the reference: a horizontal line
                value = _mean([float(r[key]) for r in mine if r.get(key) is not None])
                ax.axhline(value, linestyle="--", color=styles[policy]["color"], linewidth=1, label=policy)
                continue
            means[policy] = {x: _mean([float(r[key]) for r in mine if r.get("ratio") == x and r.get(key) is not None])
                             for x in ratios if any(r.get("ratio") == x for r in mine)}
        drawn = {x: _spread({p: m[x] for p, m in means.items() if x in m}) for x in ratios}
        for policy, by_ratio in means.items():
            xs = list(by_ratio)
            ys = [drawn[x][policy] for x in xs]
            spread_any = spread_any or any(y != by_ratio[x] for x, y in zip(xs, ys))
            ax.plot(xs, ys, marker=styles[policy]["marker"], color=styles[policy]["color"], markerfacecolor="none",
                    label=policy)
        if ratios:  # name the policies that end on the same value
            last = ratios[-1]
            ends: dict[float, list[str]] = {}
            for policy, by_ratio in means.items():
                if last in by_ratio and by_ratio[last] == by_ratio[last]:
                    ends.setdefault(round(by_ratio[last], 9), []).append(policy)
            for value, members in ends.items():
                if len(members) > 1:
                    names = [", ".join(members[k:k + 2]) for k in range(0, len(members), 2)]
                    # just outside the axes, so that no line (the reference's dashed one spans the axes) runs under it
                    ax.annotate(f"{value:.2f}: " + ",\n".join(names), (1.0, value), xytext=(4, 0),
                                xycoords=ax.get_yaxis_transform(), textcoords="offset points", va="center",
                                fontsize=7, annotation_clip=False)
    for ax, label in ((ax_score, "string-match score"), (ax_intact, "needle intact rate (ΔNLL < 1 nat)")):
        ax.set_xscale("log", base=2)
        if ratios:
            ax.set_xticks(ratios, [f"{x:g}x" for x in ratios])
        ax.set_ylim(-0.05 - TIE_SPREAD / 2, 1.05 + TIE_SPREAD / 2)
        ax.set_xlabel("compression ratio")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    # outside both panels, as on the frontier: inside, it covered the lines that cross the middle of the score panel
    fig.legend(handles=ax_score.get_lines(), loc="outside right upper", fontsize=8, title_fontsize=7,
               title=f"equal points offset ±{TIE_SPREAD / 2:g}" if spread_any else None)
    fig.suptitle(f"question {position} compression", fontsize=9)
    return fig


def frontier_points(rows: Sequence[dict[str, Any]], *, position: str = "after") -> dict[str, list[dict[str, Any]]]:
    """Per policy, one point per ratio: ``ratio``, ``mib_per_token`` (mean KV-path MiB read per generated token), the
    means of ``score`` and ``intact`` (None where no trial has it), ``trials``; trials without the bytes are left out."""
    ok = [r for r in rows if r["status"] == "ok" and r["question_position"] == position
          and r.get("kv_bytes_per_token") is not None]
    points: dict[str, list[dict[str, Any]]] = {}
    for policy in policy_order(ok):
        mine = [r for r in ok if r["policy"] == policy]
        for ratio in sorted({r.get("ratio") for r in mine}, key=lambda x: -1.0 if x is None else float(x)):
            cell = [r for r in mine if r.get("ratio") == ratio]
            points.setdefault(policy, []).append({
                "ratio": ratio, "mib_per_token": _mean_of(cell, "kv_bytes_per_token") / 2**20,
                "score": _mean_of(cell, "score"), "intact": _mean_of(cell, "intact"), "trials": len(cell)})
    return points


def _mean_of(rows: Sequence[dict[str, Any]], key: str) -> float | None:
    """The mean of ``key`` over the rows that have it (None: none has)."""
    values = [float(r[key]) for r in rows if r.get(key) is not None]
    return _mean(values) if values else None


# Points of one value whose bytes read differ by less than this fraction are drawn as one: their markers would cover
# each other on the log axis (chunkkv and snapkv at 4x read 24.18 and 24.24 MiB).
COINCIDENT = 0.04


def _coincident(points: dict[str, list[dict[str, Any]]], key: str) -> dict[tuple[str, Any], list[str]]:
    """``(policy, ratio)`` -> the policies whose point has the same ``key`` value and bytes read within
    :data:`COINCIDENT` of it (a chain of such points is one group), in policy order."""
    import math

    found = sorted(((round(p[key], 9), math.log(p["mib_per_token"]) if p["mib_per_token"] > 0 else -math.inf,
                     policy, p["ratio"]) for policy, pts in points.items() for p in pts if p[key] is not None),
                   key=lambda t: (t[0], t[1]))
    groups: list[list[tuple[Any, ...]]] = []
    for point in found:
        last = groups[-1][-1] if groups else None
        if last is not None and last[0] == point[0] and point[1] - last[1] < math.log1p(COINCIDENT):
            groups[-1].append(point)
        else:
            groups.append([point])
    order = {policy: k for k, policy in enumerate(points)}
    ties: dict[tuple[str, Any], list[str]] = {}
    for group in groups:
        members = sorted((policy for *_, policy, _ in group), key=order.__getitem__)
        for *_, policy, ratio in group:
            ties[(policy, ratio)] = members
    return ties


def frontier_figure(rows: Sequence[dict[str, Any]], *, position: str = "after") -> Any:
    """The quality-cost frontier: mean score (left) and needle intact rate (right) against the KV-path bytes read per
    generated token (log scale), a policy's ratios joined and labelled, the legend outside both panels."""
    plt = _pyplot()
    from matplotlib import ticker

    points = frontier_points(rows, position=position)
    if not points:
        raise ValueError(f"no successful trials with the question {position} compression and KV bytes read to plot")
    fig, axes = plt.subplots(1, 2, figsize=(12.5, 4.6), sharex=True, layout="constrained")
    styles = policy_styles(rows)
    labels: list[tuple[Any, str, tuple[float, float], dict[str, Any]]] = []  # placed once the layout is fixed
    handles = []
    spread_any = False
    for ax, key, label in ((axes[0], "score", "string-match score"),
                           (axes[1], "intact", "needle intact rate (ΔNLL < 1 nat)")):
        # policies that land on the same point (same bytes, same value: streaming_llm and h2o read alike) are
        # offset vertically by up to TIE_SPREAD / 2, so that no marker hides another
        ties = _coincident(points, key)
        for policy, pts in points.items():
            pts = [p for p in pts if p[key] is not None]
            if not pts:
                continue
            reference = all(p["ratio"] is None for p in pts)
            style = {**styles[policy], "markersize": 11 if reference else 7, "markerfacecolor": "none",
                     "linestyle": "none" if reference else "-", "linewidth": 1, "alpha": 0.9}
            xs, ys = [p["mib_per_token"] for p in pts], []
            for p in pts:
                members = ties[(policy, p["ratio"])]
                spread_any = spread_any or len(members) > 1
                ys.append(p[key] + _tie_offset(members.index(policy), len(members)))
            (line,) = ax.plot(xs, ys, label=policy if reference else f"{policy}", **style)
            if key == "score":
                handles.append(line)
            for p, y in zip(pts, ys):
                if p["ratio"] is not None:
                    labels.append((ax, f"{p['ratio']:g}x", (p["mib_per_token"], y),
                                   {"fontsize": 7, "color": style["color"]}))
        ax.set_xscale("log")
        ax.xaxis.set_major_locator(ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.xaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.xaxis.set_minor_formatter(ticker.NullFormatter())
        ax.set_ylim(-0.08, 1.12)
        ax.set_xlabel("KV bytes read per generated token (MiB, log scale)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3, which="both")
    title = "policy (ratio at each marker)" + (f"\nequal points offset ±{TIE_SPREAD / 2:g}" if spread_any else "")
    fig.legend(handles=handles, loc="outside right upper", fontsize=8, title=title, title_fontsize=8)
    fig.suptitle(f"quality against what each step reads (question {position} compression; up and left is better)",
                 fontsize=9)
    _place_labels(fig, labels)
    return fig


def frontier(rows: Sequence[dict[str, Any]], path: str | Path, *, position: str = "after") -> Path:
    """:func:`frontier_figure` as a PNG at ``path``."""
    return _save(frontier_figure(rows, position=position), path, bbox_inches="tight")


def write_plots(rows: Sequence[dict[str, Any]], out_dir: str | Path, prefix: str = "", *,
                position: str = "after") -> list[Path]:
    """The figures into ``out_dir`` (``{prefix}needle-heatmap.png`` when there are needle trials,
    ``{prefix}score-vs-ratio.png``, ``{prefix}frontier.png`` when rows count the KV bytes read); the paths written."""
    out_dir = Path(out_dir)
    written = [_save(score_vs_ratio_figure(rows, position=position), out_dir / f"{prefix}score-vs-ratio.png",
                     bbox_inches="tight")]
    if any(r.get("depth") is not None and r["status"] == "ok" for r in rows):
        written.insert(0, needle_heatmap(rows, out_dir / f"{prefix}needle-heatmap.png", position=position))
    if frontier_points(rows, position=position):
        written.append(frontier(rows, out_dir / f"{prefix}frontier.png", position=position))
    return written
