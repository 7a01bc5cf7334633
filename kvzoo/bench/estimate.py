"""How long a grid will take, before it starts: a per-policy cost model (:data:`COSTS`: prefill per 1000 tokens, once per
shared prefill, a per-step cost and a fixed part) measured on SmolLM2-135M, fp32, one thread of the 2-core
development CPU (``docs/scaling.md``); elsewhere the estimate is only a scale, and says so.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvzoo.bench.report import REFERENCE_POLICY


@dataclass(frozen=True)
class Cost:
    """One policy's trial cost on the calibration machine (seconds, one thread)."""

    prefill_per_ktoken: float  # its own prefill, per 1000 prompt tokens
    step: float  # one decode step (teacher-forced or greedy)
    fixed: float  # the question's forward, compression, the forks


# measured on smollm2-135m float32, 1 thread, niah_single 2k tokens at 8x, question after and before, on a 2-core
# machine with other work on it (docs/scaling.md: the command and the figures)
COSTS: dict[str, Cost] = {
    "full": Cost(4.5, 0.12, 0.3),
    "streaming_llm": Cost(4.3, 0.10, 0.2),
    "snapkv": Cost(4.5, 0.105, 0.35),
    "chunkkv": Cost(4.5, 0.10, 0.3),
    "h2o": Cost(14.5, 0.13, 0.2),
    "quest": Cost(4.9, 0.14, 0.3),
    "vestige": Cost(5.0, 0.13, 0.3),
}
DEFAULT_COST = Cost(6.0, 0.13, 0.3)  # a policy not measured (a plugin's)
ONE_FORWARD_STEPS = 7  # the two one-forward passes of Grid.one_forward, in decode steps' worth
CONTINUATION_OVERSHOOT = 1.3  # the held-out text is whole sentences: 32 tokens asked gave 36-43
# the reference answer's tokens, teacher-forced (SmolLM2's tokenizer; measured at 2k tokens); another task: 40 % of
# the tokens it may generate
ANSWER_TOKENS = {"niah_single": 9, "niah_multikey": 9, "niah_multivalue": 36, "niah_multiquery": 36, "vt": 24,
                 "cwe": 24}
QUESTION_TOKENS = 40  # a question with its answer prefix (added to the prompt when asked before compression)
CALIBRATION = "smollm2-135m float32, 1 thread per worker, a 2-core x86 CPU"


@dataclass
class Estimate:
    """Estimated seconds of the trials given to :func:`estimate`."""

    trials: int
    by_policy: dict[str, tuple[int, float]]  # policy -> (trials, seconds in all)

    @property
    def seconds(self) -> float:
        return sum(s for _, s in self.by_policy.values())


def cost_of(policy: str) -> Cost:
    """The :class:`Cost` of policy spec ``policy`` (``quest(gqa=group)`` costs as ``quest``)."""
    return COSTS.get(policy.split("(", 1)[0].strip(), DEFAULT_COST)


def _prompt_tokens(trial: Any) -> int:
    return trial.task.context_tokens + (QUESTION_TOKENS if trial.position == "before" else 0)


def trial_seconds(trial: Any, grid: Any, *, prefill: bool = True, prefill_tokens: int | None = None) -> float:
    """Estimated seconds of ``trial`` of ``grid``; ``prefill=False``: without its prefill (a fork of a shared one);
    ``prefill_tokens``: with a prefill of that many tokens (the rest of a shared first block)."""
    from kvzoo.bench.tasks import MAX_NEW_TOKENS

    cost = cost_of(trial.policy)
    prompt = _prompt_tokens(trial)
    allowed = grid.max_new_tokens or MAX_NEW_TOKENS[trial.task.task]
    generated = round(0.9 * allowed)  # greedy decoding stops once answered, or runs to the end
    answer = ANSWER_TOKENS.get(trial.task.task, max(1, round(0.4 * allowed)))
    continuation = round(CONTINUATION_OVERSHOOT * grid.continuation_tokens) if trial.position == "after" else 0
    steps = max(0, continuation - 1) + (answer - 1) + generated
    seconds = cost.fixed + cost.step * (steps + (ONE_FORWARD_STEPS if grid.one_forward else 0))
    prefilled = (prompt if prefill else 0) if prefill_tokens is None else prefill_tokens
    return seconds + cost.prefill_per_ktoken * prefilled / 1000


def estimate(trials: Sequence[Any], grid: Any) -> Estimate:
    """The estimated time of ``trials`` (of ``grid``): each priced by :func:`trial_seconds`, each shared prefill
    (dense, recording attention, a first block) once per (model, task, question position), by the first policy to
    continue it; a policy continuing a first block pays the rest of its prompt."""
    from kvzoo.bench.planner import build_policy
    from kvzoo.bench.trial import SharedPrefill

    by_policy: dict[str, tuple[int, float]] = {}
    prefilled: set[tuple[str, str]] = set()
    shares: dict[tuple[str, float | None, int], tuple[str, int] | None] = {}  # SharedPrefill.kind (None: its own)
    for trial in trials:
        prompt = _prompt_tokens(trial)
        key = (trial.policy, trial.ratio, prompt)
        if key not in shares:
            try:
                built = build_policy(trial.policy, trial.ratio)
            except Exception:  # noqa: BLE001 - it will be recorded as skipped: it costs nothing
                shares[key] = None
            else:
                shares[key] = SharedPrefill.kind(built, prompt, grid.chunk_size)
        kind = shares[key]
        if kind is None:
            seconds = trial_seconds(trial, grid)
        else:
            group = (trial.reference().key, kind[0])
            own = prompt - kind[1] + (kind[1] if group not in prefilled else 0)
            prefilled.add(group)
            seconds = trial_seconds(trial, grid, prefill_tokens=own)
        n, total = by_policy.get(trial.policy, (0, 0.0))
        by_policy[trial.policy] = (n + 1, total + seconds)
    return Estimate(len(trials), by_policy)


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def describe(est: Estimate, workers: int | None) -> str:
    """One line: trials, seconds per trial by policy, the total, and on how many workers (None: unknown, as many as
    a Ray cluster holds)."""
    order = sorted(est.by_policy, key=lambda p: (p != REFERENCE_POLICY, p))
    per = ", ".join(f"{p} {s / n:.0f}" for p in order for n, s in [est.by_policy[p]])
    total = est.seconds
    where = (f"{_duration(total / workers)} on {workers} worker{'s' if workers != 1 else ''}" if workers
             else f"{_duration(total)} on one worker, divided by the workers the cluster gives")
    return (f"kvzoo leaderboard: estimated time (a cost model calibrated on {CALIBRATION}; an estimate): "
            f"{est.trials} trial{'s' if est.trials != 1 else ''}, s/trial by policy: {per}; {_duration(total)} of trials in all, {where}")
