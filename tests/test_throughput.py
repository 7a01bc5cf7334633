"""``benchmarks/throughput.py`` at toy size: the batch each arm gets fits the budget it was given, counted over every
tensor the arm holds; and a ragged batch (left-padded) decodes each sequence as it decodes alone, for every policy.

The ragged test covers what the other batch tests do not (``test_cache.py``: ``full``, left-padded;
``test_reliability_fixes.py``: vestige and quest beside another sequence of the same length, and vestige's kept rows
under padding). Where a batch cannot equal each sequence alone it says why and is not run:

* a block or page schedule closes blocks at the batch's slots, not at each sequence's own: a left-padded sequence's
  blocks (VestigeKV's, ``block_size`` shorter than the context) and pages (Quest's, padding not a multiple of
  ``page_size``) are not those it has alone, and its tier keeps as many rows as the longest sequence's;
* VestigeKV's retriever ranks the padding rows archived beside a sequence's own and fetches some of them (masked in
  the attention): the padded sequence reads fewer real rows than alone (measured: 15 of 32 rows one step fetched
  were padding). The int8 index has no per-row validity to rank them last.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from kvzoo import TieredCache, registry
from tests.greedy import assert_same_greedy, generated_logits

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture
def throughput(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    sys.modules.pop("throughput", None)
    import throughput

    return throughput


def test_the_toy_run_gives_each_arm_the_largest_batch_its_budget_holds(throughput, tmp_path, capsys):
    out = tmp_path / "rows.jsonl"
    assert throughput.main(["--toy", "--json", str(out)]) == 0
    rows = {r["arm"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert list(rows) == throughput.TOY["arms"].split(",")
    budget = int(throughput.TOY["budget_gib"] * 2**30)
    for arm, r in rows.items():
        per_sequence = r["per_sequence_bytes"]
        assert r["batch"] == min(r["max_batch"], budget // per_sequence) >= 1, arm
        assert r["batch_capped"] or (r["batch"] + 1) * per_sequence > budget, arm
        # checked at the batch, after the timed steps: every tensor the arm holds then
        assert r["within_budget"] and r["bytes_at_batch"] <= budget, arm
        assert r["bytes_at_batch"] >= 0.95 * r["batch"] * per_sequence, arm
        assert r["step_cpu_s_1t"] > 0 and r["tokens_per_s_1t"] == pytest.approx(r["batch"] / r["step_cpu_s_1t"])
        assert r["mode"] == "budget" and r["versions"]["torch"] and r["finished_at"]
    assert rows["full"]["ratio_to_full_1t"] == pytest.approx(1.0)
    # evictors free their rows: more sequences; the retrievers keep theirs in the archive: no more than full
    assert rows["snapkv@8"]["batch"] > rows["full"]["batch"] and rows["streaming_llm@8"]["batch"] > rows["full"]["batch"]
    for arm in ("vestige@8", "quest@8"):
        assert rows[arm]["holds"]["archive"] > 0 and rows[arm]["batch"] <= rows["full"]["batch"]
    assert rows["transformers"]["holds"]["other"] == 0 and rows["snapkv@8"]["holds"]["archive"] == 0
    assert "| snapkv@8 |" in capsys.readouterr().out


def test_the_toy_scaling_run_reports_the_per_sequence_cost(throughput, tmp_path):
    out = tmp_path / "rows.jsonl"
    assert throughput.main(["--toy", "--scaling", "--arms", "full,snapkv@8", "--group", "1", "--json", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["arm"], r["batch"]) for r in rows] == [("full", 1), ("full", 8), ("snapkv@8", 1), ("snapkv@8", 8)]
    for one, eight in (rows[:2], rows[2:]):
        assert one["per_sequence_cost_vs_batch1_1t"] == pytest.approx(1.0)
        assert eight["per_sequence_cost_vs_batch1_1t"] == pytest.approx(
            eight["step_cpu_s_1t"] / 8 / one["step_cpu_s_1t"])


def test_held_bytes_counts_every_storage_once_and_grows_with_the_batch(throughput, tiny):
    from transformers import DynamicCache

    ids = torch.randint(1, 256, (1, 200), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        cache = TieredCache(tiny, registry.get("vestige", budget=24, block_size=64))
        tiny(input_ids=ids, cache=cache, use_cache=True)
        cache.compress()
        one = throughput.held_bytes(cache)
        assert one["archive"] > 0 and one["index"] > 0 and one["other"] > 0
        assert one["total"] == one["tier"] + one["archive"] + one["index"] + one["other"]
        cache.batch_repeat_interleave(3)
        three = throughput.held_bytes(cache)
        assert 2.9 * one["total"] <= three["total"] <= 3 * one["total"]
        plain = DynamicCache(config=tiny.config)
        for i, layer in enumerate(cache.tiered_layers):
            plain.update(layer.keys, layer.values, i)
        kv = sum(t.numel() * t.element_size() for layer in cache.tiered_layers for t in (layer.keys, layer.values))
        assert throughput.held_bytes(plain) == {"total": kv, "tier": kv, "archive": 0, "index": 0, "other": 0}
    assert throughput.fit_batch(10, 35, 128) == 3 and throughput.fit_batch(10, 5, 128) == 0
    assert throughput.fit_batch(1, 10**6, 128) == 128


# Policies at sizes where a batch and each sequence alone keep the same rows: fixed budgets (a ratio counts the
# padded length), VestigeKV's one block the whole context and no retriever, Quest's padding whole pages.
RAGGED = {
    "snapkv": ("snapkv", {"budget": 32, "window": 8}, 40),
    "streaming_llm": ("streaming_llm", {"budget": 32}, 40),
    "h2o": ("h2o", {"budget": 32}, 40),
    "chunkkv": ("chunkkv", {"budget": 32, "window": 8}, 40),
    "quest": ("quest", {"budget": 48, "dense_layers": 0}, 48),  # 3 pages of 16
    "vestige (no retriever)": ("vestige", {"budget": 24, "block_size": 4096, "retriever": None}, 40),
}


def test_the_ragged_cases_cover_every_registered_policy():
    assert {name for name, _, _ in RAGGED.values()} | {"full"} == set(registry.available())


@pytest.mark.parametrize("case", list(RAGGED))
def test_a_left_padded_batch_decodes_each_sequence_as_alone(tiny, case):
    name, params, pad = RAGGED[case]
    policy = registry.get(name, **params)
    g = torch.Generator().manual_seed(3)
    a, b = torch.randint(1, 256, (1, 160), generator=g), torch.randint(1, 256, (1, 160 - pad), generator=g)
    ids = torch.cat([a, torch.cat([torch.zeros(1, pad, dtype=torch.long), b], dim=1)])
    mask = (torch.arange(160) >= torch.tensor([[0], [pad]])).long()

    def generate(ids, mask=None):
        return tiny.generate(ids, attention_mask=mask, max_new_tokens=10, min_new_tokens=10, do_sample=False,
                             cache=TieredCache(tiny, policy), output_logits=True, return_dict_in_generate=True,
                             pad_token_id=0)

    with torch.no_grad():
        together = generate(ids, mask)
        for row, sequence in enumerate((a, b)):
            alone = generate(sequence)
            assert_same_greedy(alone.sequences[0, -10:], together.sequences[row, -10:], generated_logits(alone),
                               generated_logits(together, row))
