"""pytest-benchmark leaderboard: time prefill+compression and decode steps per policy, quality in ``extra_info``.

    .venv/bin/python -m pytest benchmarks --benchmark-only --benchmark-json=bench.json
    .venv/bin/python benchmarks/render_json.py bench.json      # the same markdown table as `kvzoo leaderboard`

Each ``test_prefill_compress`` case also runs one full trial per question position (the runner's
``run_trial``) and stores its row -- score, intact, ΔNLL, ΔCE, bytes per step, resident bytes --
in ``benchmark.extra_info["leaderboard_rows"]``, so the JSON pytest-benchmark writes is a leaderboard.
"""

from __future__ import annotations

import pytest
import torch
from conftest import DECODE_STEPS, MODEL, POSITIONS, ROUNDS

from kvzoo import TieredCache
from kvzoo.bench.runner import build_policy, encode_prompt, run_trial


def _policy_or_skip(name: str, ratio: float | None):
    try:
        return build_policy(name, ratio)
    except (KeyError, TypeError, ValueError) as err:
        pytest.skip(f"{name} at ratio {ratio}: {err}")


def test_prefill_compress(benchmark, case, bench_model, bench_task, references):
    name, ratio = case
    policy = _policy_or_skip(name, ratio)
    model, tokenizer = bench_model
    prefix = encode_prompt(tokenizer, bench_task).prefix

    @torch.no_grad()
    def prefill_and_compress() -> None:
        cache = TieredCache(model, policy, context_length=prefix.shape[1])
        model(input_ids=prefix, cache=cache, use_cache=True, logits_to_keep=1)
        cache.compress()

    benchmark.pedantic(prefill_and_compress, rounds=ROUNDS, iterations=1)
    rows = []
    for position in POSITIONS:
        row = run_trial(model, tokenizer, bench_task, policy, position=position, reference=references[position])
        row.update(status="ok", error=None, model=MODEL, **bench_task.spec.as_dict(), policy=name, ratio=ratio,
                   question_position=position, policy_config=policy.config())
        rows.append(row)
    after = next((r for r in rows if r["question_position"] == "after"), rows[0])
    benchmark.extra_info.update(
        policy=name, ratio=ratio, model=MODEL, task=bench_task.spec.key, score=after["score"],
        intact=after["intact"], delta_nll=after["delta_nll"], delta_ce=after["delta_ce"],
        kv_bytes_per_step=after["kv_bytes_per_step"], resident_bytes=after["resident_bytes"],
        leaderboard_rows=rows,
    )


def test_decode_steps(benchmark, case, bench_model, bench_task):
    name, ratio = case
    policy = _policy_or_skip(name, ratio)
    model, tokenizer = bench_model
    ids = encode_prompt(tokenizer, bench_task)

    @torch.no_grad()
    def setup():
        cache = TieredCache(model, policy, context_length=ids.prefix.shape[1])
        model(input_ids=ids.prefix, cache=cache, use_cache=True, logits_to_keep=1)
        cache.compress()
        logits = model(input_ids=ids.question, cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
        return (cache, logits.argmax(-1, keepdim=True)), {}

    @torch.no_grad()
    def decode(cache, token) -> None:
        for _ in range(DECODE_STEPS):
            token = model(input_ids=token, cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1].argmax(-1, keepdim=True)

    benchmark.pedantic(decode, setup=setup, rounds=ROUNDS, iterations=1)
    benchmark.extra_info.update(policy=name, ratio=ratio, model=MODEL, decode_steps=DECODE_STEPS)
