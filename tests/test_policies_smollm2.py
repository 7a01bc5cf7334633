"""SnapKV, H2O and ChunkKV end to end on the real SmolLM2-135M-Instruct, question after compression, ratio 4."""

from __future__ import annotations

import pytest

from kvzoo import registry
from kvzoo.pipeline import generate

pytestmark = pytest.mark.smollm2

RATIO = 4
MAX_NEW_TOKENS = 4


def context_text() -> str:
    towns = ["Arden", "Bellmoor", "Dunmore", "Eastwick", "Glenhaven", "Larkspur", "Northfield", "Pinecrest"]
    lines = [
        f"In {towns[i % len(towns)]}, the market on street {i} opens at {6 + i % 5} o'clock and sells "
        f"bread, apples and wool to the people of the valley."
        for i in range(18)
    ]
    lines.insert(7, "The special magic number for Lisbon is 7381924.")
    return " ".join(lines)


@pytest.mark.parametrize("name", ["snapkv", "h2o", "chunkkv"])
def test_policy_runs_end_to_end_at_ratio_4(smollm2, name):
    model, tokenizer = smollm2
    policy = registry.get(name, ratio=RATIO)
    result = generate(model, tokenizer, context_text(), "What is the special magic number for Lisbon?", policy,
                      max_new_tokens=MAX_NEW_TOKENS)
    assert model.config._attn_implementation == "kvzoo"  # the observed attention needs no eager mode
    context = result.context_tokens
    assert 500 <= context <= 800 and result.question_tokens > 0
    assert 1 <= len(result.token_ids) <= MAX_NEW_TOKENS
    budget = context // RATIO
    after_context = result.question_tokens + len(result.token_ids) - 1  # the last token is never fed back
    stats = result.stats
    assert len(stats.layers) == 30
    for s in stats.layers:
        assert s.seen_rows == context + after_context
        if name == "h2o":
            assert s.resident_rows == budget  # held at the budget through the question and decoding
        else:
            assert s.resident_rows == budget + after_context  # only the context is compressed
        evicted = s.seen_rows - s.resident_rows  # kept in the archive where a retriever reads it, else dropped
        assert (s.archived_rows, s.dropped_rows) == ((evicted, 0) if policy.retriever is not None else (0, evicted))
    if name == "chunkkv":
        assert stats.totals["chunkkv_scored"] == stats.totals["chunkkv_reused"] == 15  # 30 layers, reuse=2
