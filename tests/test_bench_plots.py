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
        assert fig.axes[0].get_legend().get_title().get_text() == "equal points offset ±0.04"
    finally:
        plots._pyplot().close(fig)


def test_untied_points_are_drawn_at_their_values():
    values = {"snapkv": (1.0, 0.5), "h2o": (0.0, 0.0)}  # no ties in the scores nor in the intact rates
    fig = plots.score_vs_ratio_figure(_rows(values))
    try:
        ax = fig.axes[0]
        drawn = {line.get_label(): tuple(line.get_ydata()) for line in ax.get_lines() if line.get_label() in values}
        assert drawn == values
        assert len(ax.texts) == 0 and fig.axes[0].get_legend().get_title().get_text() == ""
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
