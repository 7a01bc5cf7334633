"""kvzoo.bench.plots: policies with equal scores stay distinguishable in the score-vs-ratio figure."""

from __future__ import annotations

import pytest

from kvzoo.bench import plots


def _rows(values: dict[str, tuple[float, float]]) -> list[dict]:
    rows = [dict(status="ok", question_position="after", policy="full", ratio=None, score=1.0, intact=True)]
    for policy, by_ratio in values.items():
        for ratio, value in zip((4.0, 8.0), by_ratio):
            rows.append(dict(status="ok", question_position="after", policy=policy, ratio=ratio, score=value,
                             intact=bool(value)))
    return rows


# make demo's shape: five policies at 0.0 and three at 1.0 at 8x
DEMO_LIKE = {"streaming_llm": (0.0, 0.0), "snapkv": (1.0, 1.0), "h2o": (0.0, 0.0), "chunkkv": (1.0, 0.0),
             "quest": (1.0, 1.0), "vestige": (1.0, 1.0), "pyramid": (0.0, 0.0), "tova": (0.0, 0.0)}


def _policy_lines(ax) -> dict[str, tuple[tuple[float, ...], tuple[float, ...], str]]:
    return {line.get_label(): (tuple(line.get_xdata()), tuple(line.get_ydata()), line.get_marker())
            for line in ax.get_lines() if line.get_label() in DEMO_LIKE}


def test_tied_policies_draw_distinct_lines_and_markers_and_are_named_at_the_end():
    fig = plots.score_vs_ratio_figure(_rows(DEMO_LIKE))
    try:
        for ax in fig.axes[:2]:
            lines = _policy_lines(ax)
            assert set(lines) == set(DEMO_LIKE)
            assert len({ys for _, ys, _ in lines.values()}) == len(DEMO_LIKE)  # no two lines on top of each other
            assert len({marker for *_, marker in lines.values()}) == len(DEMO_LIKE)
            for policy, (xs, ys, _) in lines.items():  # each point within the spread of its true value
                assert xs == (4.0, 8.0)
                assert ys == pytest.approx(DEMO_LIKE[policy], abs=plots.TIE_SPREAD / 2 + 1e-12)
            labels = sorted(t.get_text() for t in ax.texts)
            assert labels == ["0.00: streaming_llm, h2o,\nchunkkv, pyramid,\ntova", "1.00: snapkv, quest,\nvestige"]
        assert fig.legends[0].get_title().get_text() == "equal points offset ±0.04"
    finally:
        plots._pyplot().close(fig)


def test_untied_points_are_drawn_at_their_values():
    values = {"snapkv": (1.0, 0.5), "h2o": (0.0, 0.0)}  # no ties in the scores nor in the intact rates
    fig = plots.score_vs_ratio_figure(_rows(values))
    try:
        ax = fig.axes[0]
        drawn = {line.get_label(): tuple(line.get_ydata()) for line in ax.get_lines() if line.get_label() in values}
        assert drawn == values
        assert len(ax.texts) == 0 and fig.legends[0].get_title().get_text() == ""
    finally:
        plots._pyplot().close(fig)


def test_spread_keeps_groups_within_the_spread_and_in_policy_order():
    drawn = plots._spread({"a": 0.5, "b": 0.5, "c": 0.5, "d": 0.25, "e": float("nan")})
    assert drawn["a"] < drawn["b"] < drawn["c"]
    assert drawn["b"] == pytest.approx(0.5) and drawn["c"] - drawn["a"] <= plots.TIE_SPREAD
    assert drawn["d"] == 0.25 and drawn["e"] != drawn["e"]


def test_a_policy_has_one_colour_and_marker_in_every_figure_and_ratio_labels_do_not_overlap():
    from matplotlib.colors import to_hex

    rows = _rows(DEMO_LIKE)
    for k, row in enumerate(rows):  # the frontier needs the bytes read; close together so that labels crowd
        row["kv_bytes_per_token"] = 2**20 * (10 + (k % 3) * 0.2)
    styles = plots.policy_styles(rows)
    assert styles["full"] == {"color": "black", "marker": "*"}
    assert len({(s["color"], s["marker"]) for s in styles.values()}) == len(styles)
    curves, frontier = plots.score_vs_ratio_figure(rows), plots.frontier_figure(rows)
    try:
        for fig in (curves, frontier):
            for ax in fig.axes[:2]:
                for line in ax.get_lines():
                    if line.get_label() in DEMO_LIKE:
                        wanted = styles[line.get_label()]
                        assert (to_hex(line.get_color()), line.get_marker()) == (wanted["color"], wanted["marker"])
        renderer = frontier.canvas.get_renderer()
        for ax in frontier.axes[:2]:
            boxes = [t.get_window_extent(renderer) for t in ax.texts]
            assert len(boxes) == 2 * len(DEMO_LIKE)
            overlapping = [(i, j) for i in range(len(boxes)) for j in range(i) if boxes[i].overlaps(boxes[j])]
            assert len(overlapping) <= 2, overlapping  # crowded: the ten offsets may run out for a few
    finally:
        plots._pyplot().close(curves)
        plots._pyplot().close(frontier)


def _needle_rows(policies: tuple[str, ...]) -> list[dict]:
    return [dict(status="ok", question_position="after", task="niah_single", haystack="essay", context_tokens=2000,
                 depth=depth, policy=policy, ratio=ratio, score=1.0)
            for policy in policies for ratio in (4.0, 8.0) for depth in (0.25, 0.75)]


@pytest.mark.parametrize("policies", [("quest",), tuple(f"p{k}" for k in range(8))])
def test_the_heatmap_title_fits_its_figure_however_few_the_panels(policies):
    fig = plots.needle_heatmap_figure(_needle_rows(policies))
    try:
        fig.canvas.draw()
        title, page = fig._suptitle.get_window_extent(), fig.bbox
        assert page.x0 <= title.x0 and title.x1 <= page.x1 and title.y1 <= page.y1, (title, page)
        assert fig._suptitle.get_text().replace("\n", " ") == "niah_single score on essay text, question after compression"
        assert ("\n" in fig._suptitle.get_text()) == (len(policies) == 1)  # wrapped only where it would not fit
    finally:
        plots._pyplot().close(fig)


# make demo's frontier (docs/results/demo.jsonl, the policies as built now): (MiB read per token, score, intact) at
# 4x and 8x; at 8x four policies lie within 2 MiB of each other at 0, where ratio labels went beside other markers
DEMO_FRONTIER = {"streaming_llm": ((22.38, 0, 0), (11.26, 0, 0)), "snapkv": ((24.24, 0, 0), (13.12, 0, 0)),
                 "h2o": ((22.38, 0, 0), (11.26, 0, 0)), "chunkkv": ((24.18, 0.5, 0), (13.12, 0, 0)),
                 "quest": ((46.14, 1, 0), (30.76, 0, 0)), "vestige": ((39.81, 1, 1), (31.11, 1, 1))}


def _frontier_rows(points: dict) -> list[dict]:
    rows = [dict(status="ok", question_position="after", policy="full", ratio=None, score=1.0, intact=True,
                 kv_bytes_per_token=90.88 * 2**20)]
    for policy, by_ratio in points.items():
        for ratio, (mib, score, intact) in zip((4.0, 8.0), by_ratio):
            rows.append(dict(status="ok", question_position="after", policy=policy, ratio=ratio, score=float(score),
                             intact=bool(intact), kv_bytes_per_token=mib * 2**20))
    return rows


def _label_geometry(fig):
    """Per panel: each ratio label's text box, its own marker's centre, whether it has a leader line, and every
    marker's (centre, box), in display units."""
    from matplotlib.text import Text

    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    panels = []
    for ax in fig.axes[:2]:
        markers = plots._marker_boxes(ax)
        labels = [(Text.get_window_extent(t, renderer), tuple(ax.transData.transform(t.xy)), t.arrow_patch is not None)
                  for t in ax.texts]
        panels.append((labels, markers))
    return panels


@pytest.mark.parametrize("points", [DEMO_FRONTIER, {**DEMO_FRONTIER, **{f"close{k}": ((22.5 + k, 0, 0), (11.4 + k / 4, 0, 0))
                                                                         for k in range(3)}}])
def test_each_frontier_ratio_label_is_nearer_its_own_marker_and_over_no_marker_or_label(points):
    import math

    fig = plots.frontier_figure(_frontier_rows(points))
    try:
        for labels, markers in _label_geometry(fig):
            assert len(labels) == 2 * len(points)
            boxes = [box for box, *_ in labels]
            assert not [(i, j) for i in range(len(boxes)) for j in range(i) if boxes[i].overlaps(boxes[j])]
            for box, own, leader in labels:
                centre = ((box.x0 + box.x1) / 2, (box.y0 + box.y1) / 2)
                assert not any(box.overlaps(marker) for _, marker in markers), (box, own)
                if not leader:  # beside its marker: nearer it than any other (a leader line says whose it is)
                    nearest = min(math.dist(centre, c) for c, _ in markers)
                    assert math.dist(centre, own) == pytest.approx(nearest), (box, own)
        if points is DEMO_FRONTIER:  # room enough beside every marker: no leader lines
            assert not any(leader for labels, _ in _label_geometry(fig) for *_, leader in labels)
    finally:
        plots._pyplot().close(fig)


def test_the_score_vs_ratio_legend_and_end_labels_cover_no_line_nor_each_other():
    fig = plots.score_vs_ratio_figure(_rows(DEMO_LIKE))
    try:
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        legend = fig.legends[0].get_window_extent(renderer)
        texts = [t.get_window_extent(renderer) for ax in fig.axes[:2] for t in ax.texts]
        assert len(texts) == 4
        for ax in fig.axes[:2]:
            assert not legend.overlaps(ax.get_window_extent(renderer))
            for line in ax.get_lines():
                path = line.get_transform().transform_path(line.get_path())
                assert not path.intersects_bbox(legend, filled=False)
                assert not any(path.intersects_bbox(box, filled=False) for box in texts), line.get_label()
        boxes = texts + [legend] + [ax.get_window_extent(renderer) for ax in fig.axes[:2]]
        assert not [(i, j) for i in range(len(boxes)) for j in range(i) if boxes[i].overlaps(boxes[j])]
        page = fig.bbox
        assert all(page.x0 <= b.x0 and b.x1 <= page.x1 for b in boxes)
    finally:
        plots._pyplot().close(fig)
