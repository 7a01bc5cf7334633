"""Fixtures of the pytest-benchmark leaderboard (``pytest benchmarks --benchmark-only``).

Settings come from the environment, so a run is a command line:

    KVZOO_BENCH_MODEL      smollm2-135m (default), tiny-llama, tiny-deepseek-v2, tiny-kimi-linear, a local dir
    KVZOO_BENCH_CONTEXT    context tokens of the single-needle task (default 1024)
    KVZOO_BENCH_DEPTH      needle depth (default 0.5)
    KVZOO_BENCH_RATIOS     compression ratios, space-separated (default "4 8")
    KVZOO_BENCH_POSITIONS  question positions for the quality figures (default "after"; "after before" adds the gap)
    KVZOO_BENCH_ROUNDS     timed rounds per benchmark (default 2)
    KVZOO_BENCH_STEPS      decode steps per timed round (default 8)

The cases -- every registered policy at every ratio, ``full`` once -- are read from the registry
when the tests are collected, so a new policy (a built-in or a plugin's) is benchmarked with no
code change.
"""

from __future__ import annotations

import os

import pytest

from kvzoo import registry
from kvzoo.bench.runner import REFERENCE_POLICY, Reference, load, needs_ratio, run_trial
from kvzoo.bench.tasks import TaskSpec, make_task

MODEL = os.environ.get("KVZOO_BENCH_MODEL", "smollm2-135m")
CONTEXT = int(os.environ.get("KVZOO_BENCH_CONTEXT", "1024"))
DEPTH = float(os.environ.get("KVZOO_BENCH_DEPTH", "0.5"))
RATIOS = [float(r) for r in os.environ.get("KVZOO_BENCH_RATIOS", "4 8").split()]
POSITIONS = os.environ.get("KVZOO_BENCH_POSITIONS", "after").split()
ROUNDS = int(os.environ.get("KVZOO_BENCH_ROUNDS", "2"))
DECODE_STEPS = int(os.environ.get("KVZOO_BENCH_STEPS", "8"))


def cases() -> list[tuple[str, float | None]]:
    """(policy, ratio) for every registered policy: the reference once, the others at each ratio."""
    out: list[tuple[str, float | None]] = []
    for name in registry.available():
        if name == REFERENCE_POLICY or not needs_ratio(name):
            out.append((name, None))
        else:
            out.extend((name, ratio) for ratio in RATIOS)
    return out


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "case" in metafunc.fixturenames:
        params = cases()
        metafunc.parametrize("case", params, ids=[n if r is None else f"{n}-{r:g}x" for n, r in params])


@pytest.fixture(scope="session")
def bench_model():
    try:
        return load(MODEL)
    except FileNotFoundError as err:  # SmolLM2's weights are not installed
        pytest.skip(f"{MODEL}: {err}")


@pytest.fixture(scope="session")
def bench_task(bench_model):
    return make_task(TaskSpec("niah_single", CONTEXT, DEPTH), bench_model[1])


@pytest.fixture(scope="session")
def references(bench_model, bench_task) -> dict[str, Reference]:
    """The full cache's answer NLL and continuation CE per question position (what ΔNLL/ΔCE subtract)."""
    model, tokenizer = bench_model
    out = {}
    for position in POSITIONS:
        row = run_trial(model, tokenizer, bench_task, registry.get(REFERENCE_POLICY), position=position)
        out[position] = Reference(row["answer_nll"], row["continuation_ce"])
    return out
