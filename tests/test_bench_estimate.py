"""kvzoo.bench.estimate: the grid's estimated time, printed before it starts."""

from __future__ import annotations

import dataclasses

import pytest

from kvzoo.bench import estimate, runner
from kvzoo.bench.tasks import TaskSpec

pytestmark = pytest.mark.usefixtures("clean_registry")  # tests/conftest.py


def grid(**fields) -> runner.Grid:
    base = dict(models=("tiny-llama",), policies=("full", "snapkv", "h2o"), ratios=(2, 4),
                tasks=(TaskSpec("niah_single", 1000, 0.5),), positions=("after", "before"), continuation_tokens=32)
    return runner.Grid(**{**base, **fields})


def test_estimate_prices_each_trial_and_the_shared_prefill_once_per_group():
    g = grid()
    trials = runner.plan(g)
    est = estimate.estimate(trials, g)
    assert est.trials == len(trials) == 2 * (1 + 2 + 2)
    assert {p: n for p, (n, _) in est.by_policy.items()} == {"full": 2, "snapkv": 4, "h2o": 4}
    # full pays the group's dense prefill; snapkv continues it (no prefill of its own); h2o's first ratio pays the
    # group's prefill that records attention, its second continues it
    full = estimate.COSTS["full"]
    assert est.by_policy["full"][1] == pytest.approx(sum(estimate.trial_seconds(t, g) for t in trials[:1])
                                                     + estimate.trial_seconds(trials[5], g))
    for t in trials:
        if t.policy == "snapkv":
            assert estimate.trial_seconds(t, g, prefill=False) < estimate.trial_seconds(t, g)
    h2o = [t for t in trials if t.policy == "h2o"]
    assert est.by_policy["h2o"][1] == pytest.approx(sum(estimate.trial_seconds(t, g, prefill=i % 2 == 0)
                                                        for i, t in enumerate(h2o)))
    snapkv = est.by_policy["snapkv"][1] / 4
    assert snapkv < est.by_policy["h2o"][1] / 4
    assert snapkv * 4 == pytest.approx(sum(estimate.trial_seconds(t, g, prefill=False) for t in trials
                                           if t.policy == "snapkv"))  # no prefill in a shared policy's trial
    # question after: the continuation's decode steps; before: none, but a longer prompt
    after, before = trials[0], trials[5]
    assert after.position == "after" and before.position == "before"
    assert estimate.trial_seconds(after, g) - estimate.trial_seconds(before, g) == pytest.approx(
        (round(32 * estimate.CONTINUATION_OVERSHOOT) - 1) * full.step
        - estimate.QUESTION_TOKENS * full.prefill_per_ktoken / 1000)
    assert est.seconds == pytest.approx(sum(s for _, s in est.by_policy.values()))


def test_estimate_grows_with_the_context_the_continuation_and_the_one_forward_figures():
    base = grid()
    trials = runner.plan(base)
    seconds = estimate.estimate(trials, base).seconds
    longer = dataclasses.replace(base, tasks=(TaskSpec("niah_single", 2000, 0.5),))
    assert estimate.estimate(runner.plan(longer), longer).seconds > seconds
    assert estimate.estimate(trials, dataclasses.replace(base, continuation_tokens=0)).seconds < seconds
    assert estimate.estimate(trials, dataclasses.replace(base, one_forward=True)).seconds > seconds


def test_describe_is_one_line_naming_trials_policies_total_and_workers():
    g = grid()
    est = estimate.estimate(runner.plan(g), g)
    line = estimate.describe(est, 2)
    assert "\n" not in line and "estimate" in line and "10 trials" in line
    assert "full " in line and "snapkv " in line and "h2o " in line
    assert "on 2 workers" in line and estimate.CALIBRATION in line
    assert "divided by the workers" in estimate.describe(est, None)
    assert "on 1 worker" in estimate.describe(est, 1)


def test_an_unknown_policy_costs_the_default_and_a_variant_its_base():
    assert estimate.cost_of("quest(gqa=group)") == estimate.COSTS["quest"]
    assert estimate.cost_of("someone:Else") == estimate.DEFAULT_COST


def test_the_leaderboard_command_prints_the_estimate_before_the_first_trial(tmp_path, capsys):
    from kvzoo.cli import main

    out = tmp_path / "t.jsonl"
    assert main(["leaderboard", "--preset", "tiny", "--policies", "full", "--positions", "after", "--no-plots",
                 "--no-progress", "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "estimated time" in err and "1 trial," in err and "on 1 worker" in err
    assert main(["leaderboard", "--preset", "tiny", "--policies", "full", "--positions", "after", "--no-plots",
                 "--no-progress", "--out", str(out)]) == 0
    assert "estimated time" not in capsys.readouterr().err  # nothing left to run: nothing to estimate


def test_a_block_policy_pays_the_shared_first_block_once_and_the_rest_of_its_prompt_each_time():
    g = grid(policies=("vestige(block_size=256)",), ratios=(4, 8), positions=("after",))
    trials = [t for t in runner.plan(g) if t.policy != "full"]
    est = estimate.estimate(trials, g)
    first, second = trials
    assert est.by_policy["vestige(block_size=256)"][1] == pytest.approx(
        estimate.trial_seconds(first, g) + estimate.trial_seconds(second, g, prefill_tokens=1000 - 256))
