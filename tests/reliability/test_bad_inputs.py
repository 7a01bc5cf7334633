"""The bad-input matrix of the reliability probe (issue 13, finding 8): one row per case, each asserting the
error's type and that its message names what is valid. Cases that are not errors (an open block) assert that
the user is told where they look."""

from __future__ import annotations

import pytest
import torch

from kvzoo import TieredCache, pipeline, registry
from kvzoo.cli import main
from kvzoo.models import tiny_llama


def _ids(n, seed=0, vocab=256):
    return torch.randint(1, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


def _cli(args):
    """Run the CLI; argparse's refusals become the exit code they would have been."""
    try:
        return main(args)
    except SystemExit as stop:
        return stop.code


def empty_context(tiny, tmp_path):
    pipeline.generate(tiny, None, [], [5], "full")


def ids_outside_the_vocabulary(tiny, tmp_path):
    pipeline.generate(tiny, None, [1, 2, 300], [5], "full")


def tau_nan(tiny, tmp_path):
    registry.build_retriever("vestige", tau=float("nan"))


def zero_new_tokens_in_python(tiny, tmp_path):
    pipeline.generate(tiny, None, [1, 2, 3], [5], "full", max_new_tokens=0)


def streaming_budget_at_or_under_sinks(tiny, tmp_path):
    registry.get("streaming_llm", budget=4)


def streaming_ratio_100_on_120_tokens(tiny, tmp_path):
    tiny(input_ids=_ids(120), cache=TieredCache(tiny, registry.get("streaming_llm", ratio=100)), use_cache=True)


def cache_of_3_layers_on_a_4_layer_model(tiny, tmp_path):
    three, four = tiny_llama(num_hidden_layers=3)[0], tiny_llama(num_hidden_layers=4)[0]
    cache = TieredCache(three, registry.get("full"))
    TieredCache(four, registry.get("full"))  # four runs kvzoo's attention too: only the layer count differs
    four(input_ids=_ids(10), cache=cache, use_cache=True)


# name, action, error type, what the message must say (it names what is valid)
MATRIX = [
    ("empty context", empty_context, ValueError, r"the context is empty \(0 tokens\).*give at least one token"),
    ("ids outside the vocabulary", ids_outside_the_vocabulary, ValueError,
     r"token id 300, outside the model's vocabulary: valid ids are 0\.\.255"),
    ("tau=nan", tau_nan, ValueError, r"tau must be a finite number >= 0"),
    ("max_new_tokens=0 (Python)", zero_new_tokens_in_python, ValueError, r"max_new_tokens must be an int >= 1, got 0"),
    ("streaming_llm budget=4", streaming_budget_at_or_under_sinks, ValueError,
     r"budget \(4 rows\) must exceed sinks \(4\)"),
    ("streaming_llm ratio=100 on 120 tokens", streaming_ratio_100_on_120_tokens, ValueError,
     r"budget \(1 rows \(from ratio=100 of 120 rows\)\) must exceed sinks \(4\)"),
    ("3-layer cache on a 4-layer model", cache_of_3_layers_on_a_4_layer_model, IndexError,
     r"layer 3 does not exist in this TieredCache, which was built for a model of 3 layers"),
]


@pytest.mark.parametrize(("action", "error", "message"), [row[1:] for row in MATRIX], ids=[row[0] for row in MATRIX])
def test_bad_input_is_refused_naming_what_is_valid(tiny, tmp_path, action, error, message):
    with pytest.raises(error, match=message):
        action(tiny, tmp_path)


def _context_file(tmp_path, kind):
    path = tmp_path / f"{kind}.txt"
    if kind == "binary":
        path.write_bytes(b"\xff\xfe\x00\x01")
    elif kind == "empty":
        path.write_text("  \n")
    elif kind == "directory":
        path.mkdir()
    return path


CLI = [
    ("kvzoo run --max-new-tokens 0", lambda tmp: ["run", "--max-new-tokens", "0"], r"a token count is an int >= 1, got '0'"),
    ("--context-file missing", lambda tmp: ["run", "--context-file", str(_context_file(tmp, "missing"))],
     r"--context-file '.*missing\.txt' does not exist"),
    ("--context-file binary", lambda tmp: ["run", "--context-file", str(_context_file(tmp, "binary"))],
     r"--context-file '.*binary\.txt' is not UTF-8 text"),
    ("--context-file empty", lambda tmp: ["run", "--context-file", str(_context_file(tmp, "empty"))],
     r"--context-file '.*empty\.txt' is empty: there is no context to compress"),
    ("--context-file a directory", lambda tmp: ["run", "--context-file", str(_context_file(tmp, "directory"))],
     r"--context-file '.*directory\.txt' is a directory; give a text file"),
]


@pytest.mark.parametrize(("argv", "message"), [row[1:] for row in CLI], ids=[row[0] for row in CLI])
def test_bad_cli_input_exits_2_before_any_model_loads(tmp_path, capsys, argv, message):
    # --model names no model: reaching the loader would fail differently, so exit 2 with this message proves
    # the check ran first
    assert _cli([*argv(tmp_path), "--question", "q?", "--model", "no-such-model"]) == 2
    assert pytest.importorskip("re").search(message, capsys.readouterr().err)


def test_an_open_block_is_said_in_stats_and_the_cli_closes_it(tiny, capsys):
    """Not an error: on raw forwards vestige's default 8,192-row block has not closed on a short context, so a
    "ratio 8" cache has compressed nothing — ``stats()`` (and so the CLI summary, which prints it) says so. The CLI
    ends the context before the question, which closes the block: its summary shows the events."""
    cache = TieredCache(tiny, registry.get("vestige", ratio=8, retriever=None), auto_compress=False)
    tiny(input_ids=_ids(300, seed=9), cache=cache, use_cache=True)
    stats = cache.stats()
    assert stats.totals["events"] == 0
    assert any("no block has closed yet (300 rows wait in an open block of 8192)" in note for note in stats.notes)
    assert "note: vestige: no block has closed yet" in str(stats)
    assert _cli(["run", "--model", "tiny-llama", "--policy", "vestige", "--ratio", "8", "--context-tokens", "300",
                 "--max-new-tokens", "2"]) == 0
    out = capsys.readouterr().out
    assert "events 3," in out and "no block has closed" not in out
