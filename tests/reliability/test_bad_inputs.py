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


def float_token_ids(tiny, tmp_path):
    pipeline.generate(tiny, None, [1.5, 2.7], [5], "full")


def float_tensor_token_ids(tiny, tmp_path):
    pipeline.generate(tiny, None, torch.tensor([1.0, 2.0]), [5], "full")


def bool_token_ids(tiny, tmp_path):
    pipeline.generate(tiny, None, [True, False, True], [5], "full")


def bool_tensor_token_ids(tiny, tmp_path):
    pipeline.generate(tiny, None, torch.ones(3, dtype=torch.bool), [5], "full")


def context_past_max_position_embeddings(tiny, tmp_path):
    pipeline.generate(tiny, None, _ids(4096 - 2), [5, 6], "full", max_new_tokens=4)


def _max_new_tokens(value):
    def action(tiny, tmp_path):
        pipeline.generate(tiny, None, [1, 2, 3], [5], "full", max_new_tokens=value)

    return action


def greedy_decode_with_max_new_tokens_none(tiny, tmp_path):
    pipeline.greedy_decode(tiny, TieredCache(tiny, "full"), torch.zeros(1, 256), None, set())


def grid_with_no_policy(tiny, tmp_path):
    from kvzoo.bench.runner import Grid

    Grid(policies=[])


def grid_with_negative_continuation(tiny, tmp_path):
    from kvzoo.bench.runner import Grid

    Grid(continuation_tokens=-5)


def a_models_cache_on_another_model_that_has_one_too(tiny, tmp_path):
    other = tiny_llama(seed=1)[0]
    cache = TieredCache(tiny, registry.get("full"))
    TieredCache(other, registry.get("full"))
    with torch.no_grad():
        other(input_ids=_ids(5), cache=cache, use_cache=True)


def a_directory_without_config_json_as_model(tiny, tmp_path):
    from kvzoo.models import load_model

    load_model(str(tmp_path))


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
    # refused at its first layer since issue 22 (another model's attention), before the missing layer 3 is reached
    ("3-layer cache on a 4-layer model", cache_of_3_layers_on_a_4_layer_model, RuntimeError,
     r"layer 0 of this TieredCache was reached by a forward of another model's attention .*the model of 3 attention "
     r"layers the cache was built for\): a TieredCache belongs to the model it was created for"),
    # issue 22
    ("float token ids", float_token_ids, ValueError, r"token ids are ints \(a list of int, or an integer tensor\), got float 1\.5"),
    ("float tensor of token ids", float_tensor_token_ids, ValueError, r"token ids are ints .*got a float32 tensor"),
    ("bool token ids", bool_token_ids, ValueError, r"token ids are ints .*got bool True"),
    ("bool tensor of token ids", bool_tensor_token_ids, ValueError, r"token ids are ints .*got a bool tensor"),
    ("context past max_position_embeddings", context_past_max_position_embeddings, ValueError,
     r"the prompt \(4096 tokens\) and max_new_tokens=4 need 4099 positions, more than the model's max_position_embeddings \(4096\).*Give at most 4096 positions"),
    *[(f"max_new_tokens={value!r}", _max_new_tokens(value), ValueError, r"max_new_tokens must be an int >= 1, got ")
      for value in (2.5, float("nan"), "5", None, True)],
    ("greedy_decode max_new_tokens=None", greedy_decode_with_max_new_tokens_none, ValueError,
     r"max_new_tokens must be an int >= 1, got None"),
    ("Grid(policies=[])", grid_with_no_policy, ValueError,
     r"policies must be None \(every registered policy\) or a non-empty list of policy names"),
    ("Grid(continuation_tokens=-5)", grid_with_negative_continuation, ValueError,
     r"continuation_tokens must be an int >= 0 \(0: no held-out continuation, no ΔCE\), got -5"),
    ("a cache on another model that has one too", a_models_cache_on_another_model_that_has_one_too, RuntimeError,
     r"another model's attention .*create TieredCache\(model, policy\) for this model"),
    ("a directory without config.json as model", a_directory_without_config_json_as_model, ValueError,
     r"holds no config\.json, so it is not a transformers model directory \(one written by save_pretrained"),
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
    elif kind == "huge":
        with open(path, "wb") as fh:  # sparse: 17 MiB of zero bytes that take no disk
            fh.truncate(17 * 2**20)
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
    # issue 22
    ("--context-file /dev/zero", lambda tmp: ["run", "--context-file", "/dev/zero"],
     r"--context-file '/dev/zero' is not a regular file \(a device, FIFO or socket\); give a text file"),
    ("--context-file over 16 MiB", lambda tmp: ["run", "--context-file", str(_context_file(tmp, "huge"))],
     r"--context-file '.*huge\.txt' is larger than 16 MiB: give a text file of at most 16 MiB"),
    ("--param ratio=4 --ratio 8", lambda tmp: ["run", "--policy", "snapkv", "--param", "ratio=4", "--ratio", "8"],
     r"ratio is given twice \(--param ratio=4 and --ratio 8\): give one of them"),
    ("--param sinks twice", lambda tmp: ["run", "--policy", "streaming_llm", "--param", "sinks=4", "--param", "sinks=2"],
     r"--param sinks is given twice \(sinks=4 and 'sinks=2'\): give it once"),
    ("--param without =", lambda tmp: ["run", "--param", "sinks"], r"--param expects key=value \(e\.g\. --param sinks=4\)"),
    # issue 34: options that would do nothing with the others given
    ("run --haystack without --task", lambda tmp: ["run", "--haystack", "book"],
     r"--haystack applies to --task only \(the haystack and seed of a RULER-style task\): give --task too, or leave it "
     r"out"),
    ("run --seed without --task", lambda tmp: ["run", "--seed", "3"], r"--seed applies to --task only"),
    ("run --haystack --seed without --task", lambda tmp: ["run", "--haystack", "book", "--seed", "3"],
     r"--haystack and --seed apply to --task only"),
    ("run --task with --question", lambda tmp: ["run", "--task", "niah_single"],  # every row adds --question
     r"--question applies without --task only \(to the default needle or a --context-file\): --task niah_single asks "
     r"its own question"),
    ("run --context-file with --context-tokens",
     lambda tmp: ["run", "--context-file", str(_context_file(tmp, "binary")), "--context-tokens", "500"],
     r"--context-tokens shapes a generated context, and --context-file gives the context: leave it out"),
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
    assert "; 3 compression events" in out and "no block has closed" not in out


def test_a_model_directory_without_config_json_exits_2_naming_what_is_valid(tmp_path, capsys):
    """``kvzoo run --model /tmp``: refused before transformers is asked (no traceback)."""
    assert _cli(["run", "--model", str(tmp_path), "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert "holds no config.json, so it is not a transformers model directory" in err
    assert "valid models are smollm2-135m, gemma3-270m, tiny-llama" in err and "Traceback" not in err


@pytest.mark.parametrize("command", [["run", "--model", "no-such-model"],
                                     ["leaderboard", "--preset", "tiny", "--model", "no-such-model", "--no-progress"]])
def test_a_bogus_kvzoo_kernels_is_refused_at_start_up(monkeypatch, capsys, command):
    """``KVZOO_KERNELS=bogus``: refused before anything else is looked at (the unknown model would fail otherwise)."""
    monkeypatch.setenv("KVZOO_KERNELS", "bogus")
    assert _cli(command) == 2
    assert "KVZOO_KERNELS='bogus' is not one of ('auto', 'torch', 'triton')" in capsys.readouterr().err


LEADERBOARD = [  # argv after `kvzoo leaderboard --preset tiny`, what stderr must say
    (["--continuation-tokens", "-5"], r"--continuation-tokens is an int >= 0 \(0: no ΔCE\), got '-5'"),
    (["--policies", ""], r"--policies '' names no policy: give registered names or specs \(registered: full, "),
    (["--policies", ",", " "], r"--policies ',' ' ' names no policy"),
    (["--placement-timeout", "0", "--executor", "ray"], r"--placement-timeout is a number > 0, got '0'"),
    (["--placement-timeout", "5"], r"--placement-timeout only apply to --executor ray"),
    # issue 34: accepted silently before
    (["--no-plots", "--plot-dir", "x"], r"--plot-dir 'x' says where the plots go, and --no-plots writes none: give one "
                                        r"of them"),
    (["--out", ""], r"--out '' is empty: give a path, or leave out --out for the default \(results/tiny\.jsonl\)"),
    (["--plot-dir", " "], r"--plot-dir ' ' is empty: give a path, or leave out --plot-dir for the default"),
    (["--policies", "snapkv(window=0)"], r"--policies 'snapkv\(window=0\)': ValueError: snapkv: window must be an int "
                                         r">= 1 .*Nothing was run: such a policy would only be recorded as skipped"),
    (["--policies", "snapkv(windw=8)"], r"--policies 'snapkv\(windw=8\)': TypeError: snapkv: unknown parameter "
                                        r"'windw'; did you mean 'window'\?"),
    (["--policies", "full,snapkv(windw=8)", "streaming_llm"], r"--policies 'snapkv\(windw=8\)': TypeError"),
    (["--context-tokens", "100000000"], r"--context-tokens 100000000 cannot fit model 'tiny-llama': the context alone "
                                        r"holds at least 99000000 tokens, more than its max_position_embeddings"),
]


@pytest.mark.parametrize(("argv", "message"), LEADERBOARD, ids=[" ".join(a) for a, _ in LEADERBOARD])
def test_bad_leaderboard_input_exits_2_naming_what_is_valid(tmp_path, capsys, argv, message):
    out = tmp_path / "r.jsonl"
    assert _cli(["leaderboard", "--preset", "tiny", "--no-progress", "--out", str(out), *argv]) == 2
    assert pytest.importorskip("re").search(message, capsys.readouterr().err)
    assert not out.exists()


def test_repeated_list_options_extend_and_a_policy_named_twice_is_one_trial():
    """``--policies full --policies snapkv`` ran snapkv alone (the last one won, silently); the list options now
    extend when repeated, as ``--model`` does, and a policy or ratio named twice is planned once."""
    from kvzoo.bench import runner
    from kvzoo.cli import _grid_from_args, build_parser

    args = build_parser(["leaderboard"]).parse_args(
        ["leaderboard", "--preset", "tiny", "--policies", "full", "--policies", "snapkv,snapkv", "--ratios", "2",
         "--ratios", "4", "2", "--positions", "after", "--positions", "after"])
    grid = _grid_from_args(args)
    assert list(grid.policies) == ["full", "snapkv", "snapkv"] and grid.ratios == (2.0, 4.0, 2.0)
    assert [(t.policy, t.ratio) for t in runner.plan(grid)] == [("full", None), ("snapkv", 2.0), ("snapkv", 4.0)]


def test_plot_refuses_an_empty_out_dir(tmp_path, capsys):
    results = tmp_path / "r.jsonl"
    results.write_text('{"key": "a", "status": "error", "model": "m", "policy": "full", "task": "t", '
                       '"question_position": "after"}\n')
    assert _cli(["plot", str(results), "--out-dir", ""]) == 2
    assert "--out-dir '' is empty: give a folder, or leave out --out-dir" in capsys.readouterr().err
