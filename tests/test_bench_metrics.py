"""kvzoo.bench.metrics: every metric on a case whose value is known."""

from __future__ import annotations

import pytest
import torch

from kvzoo import registry
from kvzoo.bench import metrics
from kvzoo.bench.runner import Reference, add_reference, run_trial
from kvzoo.bench.tasks import TASKS, ByteTokenizer, make_task

BYTES = ByteTokenizer()


# --- quality -------------------------------------------------------------------------------------


def test_string_match_all_is_the_fraction_found_case_insensitively():
    assert metrics.string_match_all("The numbers are 123 and 456.", ["123", "456", "789"]) == pytest.approx(2 / 3)
    assert metrics.string_match_all("APPLE, pear", ["apple", "Pear"]) == 1.0
    assert metrics.string_match_all("", ["x"]) == 0.0


def test_string_match_part_is_one_if_any_is_found():
    assert metrics.string_match_part("it was 456", ["123", "456"]) == 1.0
    assert metrics.string_match_part("nothing", ["123", "456"]) == 0.0


def test_rulers_cleaning_turns_control_characters_into_newlines():
    # "12\x0034" would contain "1234" if the NUL were dropped; RULER turns it into a newline
    assert metrics.string_match_all("  12\x0034  ", ["1234"]) == 0.0
    assert metrics.string_match_all("\t7381924\n", ["7381924"]) == 1.0


def test_string_match_rejects_no_references_and_unknown_metrics():
    with pytest.raises(ValueError, match="at least one reference"):
        metrics.string_match_all("x", [])
    with pytest.raises(ValueError, match="valid: string_match_all, string_match_part"):
        metrics.string_match("exact", "x", ["x"])


def test_intact_below_one_nat():
    assert metrics.delta_nll(3.5, 2.0) == pytest.approx(1.5)
    assert metrics.is_intact(2.99, 2.0) is True
    assert metrics.is_intact(3.0, 2.0) is False  # exactly 1 nat is not intact
    assert metrics.is_intact(1.0, 2.0) is True  # better than full is intact


def test_mean_token_nll_is_the_cross_entropy():
    assert metrics.mean_token_nll([1.0, 2.0, 3.0]) == 2.0
    with pytest.raises(ValueError, match="no tokens"):
        metrics.mean_token_nll([])


# --- cost ----------------------------------------------------------------------------------------


def test_resident_and_freed_bytes():
    totals = {"resident_rows": 100, "resident_bytes": 51_200, "seen_rows": 400}
    assert metrics.resident_kv_bytes(totals) == 51_200
    assert metrics.kv_bytes_freed(totals) == 300 * 512
    assert metrics.kv_bytes_freed({"resident_rows": 0, "resident_bytes": 0, "seen_rows": 0}) == 0


def test_bytes_read_per_step_is_the_counters_increase_per_step():
    start = {"resident_bytes": 900, "kv_bytes_read": 10_000}
    end = {"resident_bytes": 1024, "kv_bytes_read": 10_000 + (1000 + 100 + 64) + (1024 + 100 + 64)}
    assert metrics.kv_bytes_read_per_step(start, end, 2) == pytest.approx((1000 + 100 + 64 + 1024 + 100 + 64) / 2)
    assert metrics.kv_bytes_read_per_step(start, end, 0) is None


def test_the_cache_counts_every_forwards_reads(tiny):
    """kv_bytes_read: the tier each forward attended (at attention time) + index entries + rows fetched."""
    from kvzoo import TieredCache

    ids = torch.randint(1, 256, (1, 200), generator=torch.Generator().manual_seed(0))
    row = 2 * 2 * 16 * 4  # key + value, 2 KV heads, head_dim 16, fp32
    cache = TieredCache(tiny, registry.get("streaming_llm", budget=40))
    tiny(input_ids=ids, cache=cache, use_cache=True)  # prefill reads its 200 rows, then evicts to 40
    before = cache.stats().totals["kv_bytes_read"]
    assert before == 3 * 200 * row
    for t in range(5):
        tiny(input_ids=ids[:, t : t + 1], cache=cache, use_cache=True)  # each step reads 41 rows, keeps 40
    assert cache.stats().totals["kv_bytes_read"] - before == 5 * 3 * 41 * row


def test_rows_fetched_per_step_and_bound_violations():
    assert metrics.rows_fetched_per_step({"fetched_rows": 10}, {"fetched_rows": 30}, 4) == 5.0
    assert metrics.rows_fetched_per_step({"fetched_rows": 0}, {"fetched_rows": 0}, 0) is None
    assert metrics.bound_violations({"resident_rows": 3}) is None  # not reported: "n/a"
    assert metrics.bound_violations({"bound_violations": 3.0}) == 3


def _vm_rss_bytes() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_peak_rss_is_a_high_water_mark():
    block = bytearray(64 * 2**20)  # 64 MiB, touched
    block[:: 4096] = b"x" * len(block[:: 4096])
    rss = _vm_rss_bytes()
    assert metrics.peak_rss_bytes() >= max(rss, 64 * 2**20)
    del block


# --- on a real cache -----------------------------------------------------------------------------


@pytest.mark.parametrize("task_name", TASKS)
def test_full_is_intact_with_zero_delta_ce_on_any_task(tiny, task_name: str):
    task = make_task(task_name, BYTES, context_tokens=800, depth=0.5, continuation_tokens=32)
    full = registry.get("full")
    reference_row = run_trial(tiny, BYTES, task, full, max_new_tokens=2)
    reference = Reference(reference_row["answer_nll"], reference_row["continuation_ce"])
    row = run_trial(tiny, BYTES, task, full, reference=reference, max_new_tokens=2)
    assert row["delta_nll"] == 0.0 and row["intact"] is True
    assert row["delta_ce"] == 0.0
    assert row["bytes_freed"] == 0 and row["archived_bytes"] == 0


def test_full_cache_bytes_per_step_counts_every_row(tiny):
    """3 layers x 2 KV heads x 16 dims x (key + value) x 4 bytes = 768 bytes per token; every step reads them all."""
    task = make_task("niah_single", BYTES, context_tokens=300, depth=0.5)
    row = run_trial(tiny, BYTES, task, registry.get("full"), max_new_tokens=5, stop_when_answered=False)
    assert row["decode_steps"] == 4
    tokens = row["prompt_tokens"] + row["question_tokens"]
    expected = sum((tokens + k) * 768 for k in range(1, 5)) / 4  # after step k the tier holds tokens + k rows
    assert row["kv_bytes_per_step"] == expected
    assert row["resident_bytes"] == row["prompt_tokens"] * 768
    assert row["fetched_rows_per_step"] == 0.0 and row["bound_violations"] is None
    assert row["index_bytes_per_step"] is None  # no retrieval tier, no index


def test_index_bytes_per_step_is_what_the_scans_read(tiny):
    """A retriever's rows carry the index bytes each decode step scanned: whole int8 entries (D + 6 = 22 bytes for
    16-dim heads) per archived row; the paged index reads a fraction of that (pages, then a few pages' rows)."""
    task = make_task("niah_single", BYTES, context_tokens=900, depth=0.5)
    rows = {}
    for index in ("int8", "paged"):
        paging = {"page_rows": 8, "fine_pages": 1} if index == "paged" else {}  # the paged index's own options
        retriever = registry.build_retriever("vestige", index=index, **paging)
        rows[index] = run_trial(tiny, BYTES, task, registry.get("vestige", ratio=8, retriever=retriever),
                                max_new_tokens=3, stop_when_answered=False)
        assert 0 < rows[index]["index_bytes_per_step"] < rows[index]["kv_bytes_per_step"]
    assert rows["int8"]["index_bytes_per_step"] % 22 == 0
    assert rows["paged"]["index_bytes_per_step"] < rows["int8"]["index_bytes_per_step"] / 2


def test_eviction_frees_the_rows_it_moves(tiny):
    task = make_task("niah_single", BYTES, context_tokens=300, depth=0.5)
    row = run_trial(tiny, BYTES, task, registry.get("streaming_llm", ratio=4), max_new_tokens=3)
    prompt = row["prompt_tokens"]
    kept = prompt // 4  # floor(rows / ratio) per layer and KV head
    assert row["resident_rows"] == 3 * kept  # rows per KV group, summed over the 3 layers
    assert row["bytes_freed"] == (prompt - kept) * 768
    # step schedule: each step attends the tier at its budget plus its own new row, then evicts one
    assert row["kv_bytes_per_step"] == (kept + 1) * 768


def test_add_reference_without_one_leaves_deltas_empty():
    row = {"answer_nll": 2.0, "continuation_ce": 1.0}
    add_reference(row, None)
    assert row["delta_nll"] is None and row["intact"] is None and row["delta_ce"] is None
    add_reference(row, Reference(answer_nll=0.5, continuation_ce=1.25))
    assert row["delta_nll"] == 1.5 and row["intact"] is False and row["delta_ce"] == -0.25


def test_a_multiturn_trial_asks_every_turn_on_the_one_compressed_cache_and_scores_each(tiny, monkeypatch):
    """niah_multiturn: the context compressed once; the first question, its greedy answer, then three more questions,
    each forwarded after the previous answer (its last token first: greedy decoding never ran that token's forward)
    on the same cache; a score per turn, the row's score their mean."""
    from kvzoo import pipeline

    task = make_task("niah_multiturn", BYTES, context_tokens=400, depth=0.3)
    assert len(task.later_turns) == 3 and len({t.answers for t in task.later_turns} | {task.answers}) == 4
    forwards: list[tuple[str, int, int]] = []
    prefill = pipeline.prefill

    def spy(model, cache, ids, chunk_size=None, **kwargs):
        forwards.append((kwargs.get("phase", "prefill"), cache.get_seq_length(), ids.shape[1]))
        return prefill(model, cache, ids, chunk_size, **kwargs)

    monkeypatch.setattr(pipeline, "prefill", spy)
    row = run_trial(tiny, BYTES, task, registry.get("snapkv", ratio=4), max_new_tokens=3, stop_when_answered=False,
                    one_forward=False)
    assert len(row["turn_scores"]) == 4 and row["score"] == sum(row["turn_scores"]) / 4
    assert row["later_turns_score"] == sum(row["turn_scores"][1:]) / 3
    assert row["turn_answers"][1:] == [list(t.answers) for t in task.later_turns]
    assert len(row["turn_predictions"]) == 4 and row["turns_s"] > 0
    turns = [f for f in forwards if f[0].startswith("turn ")]
    assert [f[0] for f in turns] == ["turn 2", "turn 3", "turn 4"]
    # each turn's forward starts where the cache ended: the question before it, and 3 answer tokens (2 forwarded by
    # greedy decoding, the last one first in this turn's ids)
    question = forwards[[f[0] for f in forwards].index("question")]
    after_first = question[1] + question[2] + 2
    assert turns[0][1] == after_first
    for before, after in zip(turns, turns[1:]):
        assert after[1] == before[1] + before[2] + 2
    text = "\n\n" + task.later_turns[0].question + "\n" + task.later_turns[0].answer_prefix
    assert turns[0][2] == 1 + len(text.encode())


def test_turn_text_puts_the_chat_templates_turn_boundary_between_an_answer_and_the_next_question(smollm2):
    from kvzoo.bench.tasks import Turn
    from kvzoo.bench.trial import turn_text

    tokenizer = smollm2[1]
    turn = Turn("What is the number for blue-otter?", "The number for blue-otter is:", ("1234567",))
    text = turn_text(tokenizer, "CONTEXT", [("What is the number for red-fox?", "The number is:", " 7654321.")], turn)
    assert text == ("<|im_end|>\n<|im_start|>user\nWhat is the number for blue-otter?<|im_end|>\n"
                    "<|im_start|>assistant\nThe number for blue-otter is:")
