"""kvzoo.bench.report over several tasks and context lengths: full's curve, the length a comparison reads, and the
per-length table (the ``long`` preset's report)."""

from kvzoo.bench import report


def _row(task, length, policy, ratio, score, **extra):
    return {"task": task, "context_tokens": length, "policy": policy, "ratio": ratio, "score": score, "status": "ok",
            **extra}


ROWS = [
    _row("niah_single", 8000, "full", None, 1.0), _row("niah_single", 8000, "full", None, 1.0),
    _row("niah_single", 16000, "full", None, 1.0), _row("niah_single", 16000, "full", None, 0.0),
    _row("niah_single", 16000, "full", None, 1.0), _row("niah_single", 16000, "full", None, 1.0),
    _row("niah_single", 16000, "full", None, 1.0),  # 0.8 at 16k: still compared there
    _row("niah_single", 32000, "full", None, 1.0), _row("niah_single", 32000, "full", None, 0.0),
    _row("niah_multiturn", 16000, "full", None, 0.5, later_turns_score=1 / 3),
    _row("niah_single", 8000, "vestige", 32.0, 1.0), _row("niah_single", 16000, "vestige", 32.0, 0.0),
    _row("niah_multiturn", 16000, "vestige", 32.0, 0.25, later_turns_score=0.0),
    {**_row("niah_single", 32000, "vestige", 32.0, 0.0), "status": "error"},
]


def test_the_comparison_reads_the_longest_length_where_full_answers_at_least_0_8():
    assert report.comparison_lengths(ROWS) == {"niah_single": 16000, "niah_multiturn": None}
    curve = report.full_curve(ROWS)
    assert "- niah_single: full 1.00 at 8000 (2), 0.80 at 16000 (5), 0.50 at 32000 (2) -> compare at 16000 tokens" in curve
    assert "niah_multiturn: full 0.50 at 16000 (1) -> full answers below 0.8 at every length" in curve


def test_the_length_table_has_a_column_per_task_and_length_and_marks_where_full_is_below_0_8():
    table = report.length_table(ROWS).splitlines()
    assert table[0] == ("| policy | ratio | niah_single 8000 | niah_single 16000 | niah_single 32000 (full < 0.8) | "
                        "niah_multiturn 16000 (full < 0.8) |")
    assert table[2] == "| full | — | 1.00 (2) | 0.80 (5) | 0.50 (2) | 0.50 (1) |"
    assert table[3] == "| vestige | 32x | 1.00 (1) | 0.00 (1) | - | 0.25 (1) |"  # the failed 32k trial: no cell
    later = report.length_table(ROWS, "later_turns_score").splitlines()
    assert later[2].endswith("| - | - | - | 0.33 |") and later[3].endswith("| 0.00 |")  # only multi-turn rows hold it
