"""The quality-cost frontier: each (policy, ratio) where its reads put it, the legend clear of the data."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvzoo.bench import plots

MIB = 2**20


def _rows() -> list[dict]:
    """make demo's shape: at "4x" a retriever reads about twice what an evictor reads."""
    rows = [dict(status="ok", question_position="after", policy="full", ratio=None, score=1.0, intact=True,
                 kv_bytes_per_token=90 * MIB)]
    table = {"snapkv": {4.0: (0.0, 24), 8.0: (0.0, 13)}, "quest": {4.0: (1.0, 46), 8.0: (0.0, 31)},
             "vestige": {4.0: (1.0, 40), 8.0: (1.0, 31)}}
    for policy, by_ratio in table.items():
        for ratio, (score, mib) in by_ratio.items():
            for depth, jitter in ((0.25, -1), (0.75, 1)):  # two trials a cell: the point is their mean
                rows.append(dict(status="ok", question_position="after", policy=policy, ratio=ratio, depth=depth,
                                 task="niah_single", haystack="essay", context_tokens=2000,
                                 score=score, intact=bool(score), kv_bytes_per_token=(mib + jitter) * MIB))
    rows.append(dict(status="error", question_position="after", policy="h2o", ratio=4.0))  # not drawn
    rows.append(dict(status="ok", question_position="before", policy="vestige", ratio=4.0, score=0.0, intact=False,
                     kv_bytes_per_token=MIB))  # the other position: not drawn
    return rows


def test_points_are_the_means_per_policy_and_ratio_at_the_bytes_read():
    points = plots.frontier_points(_rows())
    assert list(points) == ["full", "snapkv", "quest", "vestige"]
    assert points["full"] == [{"ratio": None, "mib_per_token": 90.0, "score": 1.0, "intact": 1.0, "trials": 1}]
    quest4 = points["quest"][0]
    assert (quest4["ratio"], quest4["mib_per_token"], quest4["score"], quest4["trials"]) == (4.0, 46.0, 1.0, 2)
    assert [p["mib_per_token"] for p in points["vestige"]] == [40.0, 31.0]


def test_figure_draws_one_marker_per_policy_and_ratio_and_keeps_the_legend_off_the_axes():
    fig = plots.frontier_figure(_rows())
    try:
        fig.canvas.draw()
        score_ax, intact_ax = fig.axes
        lines = {line.get_label(): line for line in score_ax.get_lines()}
        assert set(lines) == {"full", "snapkv", "quest", "vestige"}
        assert list(lines["quest"].get_xdata()) == [46.0, 31.0] and list(lines["quest"].get_ydata()) == [1.0, 0.0]
        assert lines["full"].get_marker() == "*" and "*" not in {lines[p].get_marker() for p in ("snapkv", "quest")}
        assert len({lines[p].get_marker() for p in ("snapkv", "quest", "vestige")}) == 3
        assert score_ax.get_xscale() == "log"
        (legend,) = fig.legends
        box = legend.get_window_extent()
        for ax in fig.axes:
            assert not box.overlaps(ax.get_window_extent()), "the legend covers a panel"
        labels = {t.get_text() for t in score_ax.texts}
        assert {"4x", "8x"} <= labels
    finally:
        plots._pyplot().close(fig)


def test_write_plots_adds_the_frontier_and_skips_it_without_bytes(tmp_path: Path):
    written = plots.write_plots(_rows(), tmp_path, prefix="d-")
    assert [p.name for p in written] == ["d-needle-heatmap.png", "d-score-vs-ratio.png", "d-frontier.png"]
    old = [{k: v for k, v in r.items() if k != "kv_bytes_per_token"} for r in _rows()]  # rows from before the counter
    assert [p.name for p in plots.write_plots(old, tmp_path / "old")] == ["needle-heatmap.png", "score-vs-ratio.png"]
    with pytest.raises(ValueError, match="KV bytes read"):
        plots.frontier_figure(old)
