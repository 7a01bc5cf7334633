"""Regression tests for the reliability probe's findings (issue 13), one or more per finding."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch

from kvzoo import TieredCache, registry
from kvzoo.bench import runner
from kvzoo.cli import main
from kvzoo.models import tiny_deepseek_v2, tiny_llama
from tests.greedy import assert_same_greedy, generated_logits

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"
ROW = ('{"key": "m|t|full|-|after|", "status": "ok", "model": "m", "task": "niah_single", "policy": "full", '
       '"ratio": null, "question_position": "after", "score": 1.0, "answer_nll": 0.5}')


def _ids(n, seed=0, vocab=256):
    return torch.randint(1, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


# --- 1. nothing the user owns is destroyed --------------------------------------------------------------


def test_plot_on_a_file_that_is_not_results_leaves_it_untouched(tmp_path, capsys):
    copy = tmp_path / "x.md"
    copy.write_bytes(README.read_bytes())
    assert main(["plot", str(copy)]) == 2
    assert copy.read_bytes() == README.read_bytes()
    assert "holds no kvzoo results rows (it was not changed)" in capsys.readouterr().err


def test_a_garbage_line_and_a_non_utf8_line_are_reported_and_kept(tmp_path):
    path = tmp_path / "r.jsonl"
    content = (ROW + "\n").encode() + b"garbage here\n" + b"\xff\xfe not utf-8\n" + (ROW.replace("full|", "x|") + "\n").encode()
    path.write_bytes(content)
    found = runner.read_results_file(path)
    assert len(found.rows) == 2 and [line for line, _ in found.bad_lines] == [2, 3]
    assert "not UTF-8" in found.bad_lines[1][1]
    assert path.read_bytes() == content  # reading never writes


def test_leaderboard_refuses_an_existing_file_that_is_not_kvzoos_without_force(tmp_path, capsys):
    out = tmp_path / "existing.md"
    out.write_text("# my notes\n\nsome text\n")
    args = ["leaderboard", "--preset", "tiny", "--policies", "full", "--no-plots", "--no-progress", "--out", str(out)]
    assert main(args) == 2
    assert out.read_text() == "# my notes\n\nsome text\n"
    assert "not a kvzoo results file" in capsys.readouterr().err and "--force" in capsys.readouterr().err + "--force"
    assert main([*args, "--fresh"]) == 2 and out.read_text() == "# my notes\n\nsome text\n"  # --fresh does not delete it


def test_resume_and_plot_survive_a_non_utf8_line(tmp_path):
    out = tmp_path / "lb.jsonl"
    args = ["leaderboard", "--preset", "tiny", "--policies", "full", "--positions", "after", "--no-plots",
            "--no-progress", "--out", str(out)]
    assert main(args) == 0
    with open(out, "ab") as fh:
        fh.write(b"\xff\xfe\n")
    before = out.read_bytes()
    assert main(args) == 0  # resumes: nothing left to run, nothing rewritten
    assert out.read_bytes() == before
    assert main(["plot", str(out), "--out-dir", str(tmp_path)]) == 0


# --- 2. a dropped cache is freed without the cycle collector: see
#        tests/test_layers.py::test_a_dropped_cache_is_freed_without_the_cycle_collector


# --- 3. beam search keeps the retrieval index in step with the archive ----------------------------------


def test_certified_bounds_hold_under_beam_search(tiny):
    retriever = registry.build_retriever("vestige", certified=True, tau=4.0)
    policy = registry.get("vestige", ratio=4, block_size=64, retriever=retriever)
    cache = TieredCache(tiny, policy, audit=True)
    tiny.generate(_ids(200, seed=1), num_beams=4, max_new_tokens=12, min_new_tokens=12, do_sample=False,
                  cache=cache, pad_token_id=0)
    totals = cache.stats().totals
    assert totals["audited_scores"] > 0 and totals["rows_fetched"] > 0
    assert totals["bound_violations"] == 0


# --- 4. a sequence's output does not depend on its batch companions --------------------------------------


@pytest.mark.parametrize("name", ["vestige", "quest"])
def test_a_sequence_decodes_the_same_alone_and_beside_another(tiny, name):
    params = {"budget": 24, "block_size": 64} if name == "vestige" else {"budget": 64, "dense_layers": 0}
    policy = registry.get(name, **params)
    a, b = _ids(150, seed=2), _ids(150, seed=3)

    def run(ids):
        cache = TieredCache(tiny, policy)
        return tiny.generate(ids, max_new_tokens=10, min_new_tokens=10, do_sample=False, cache=cache,
                             pad_token_id=0, output_logits=True, return_dict_in_generate=True)

    together = run(torch.cat([a, b]))
    for row, alone in enumerate((run(a), run(b))):  # the same tokens, up to a near tie of the logits
        assert_same_greedy(alone.sequences[0, -10:], together.sequences[row, -10:], generated_logits(alone),
                           generated_logits(together, row))


def test_vestige_with_left_padding_keeps_what_the_sequence_keeps_alone(tiny):
    """The selector's sigma is computed over each sequence's own rows, padding left out of its spectrum."""
    policy = registry.get("vestige", budget=20, block_size=10_000, retriever=None)
    a, b = _ids(120, seed=4), _ids(90, seed=5)
    ids = torch.cat([a, torch.cat([torch.zeros(1, 30, dtype=torch.long), b], dim=1)])
    mask = (torch.arange(120) >= torch.tensor([[0], [30]])).long()
    batched = TieredCache(tiny, policy)
    tiny(input_ids=ids, attention_mask=mask, cache=batched, use_cache=True)
    batched.compress()
    alone = TieredCache(tiny, policy)
    tiny(input_ids=b, cache=alone, use_cache=True)
    alone.compress()
    for layer_b, layer_alone in zip(batched.layers, alone.layers):
        kept = layer_b.slots[1, 0][layer_b.valid[1, 0]] - 30  # the padded sequence's kept rows, as token indices
        assert kept.tolist() == layer_alone.slots[0, 0].tolist()


# --- 5. a policy parameter reaches its retriever ---------------------------------------------------------------


def test_the_results_file_records_the_page_size_that_ran(tmp_path):
    rows = runner.run_grid(runner.needle_grid(models=("tiny-llama",), context_tokens=(200,), ratios=(2,),
                                              policies=("quest(page_size=8)",), positions=("after",)), tmp_path / "q.jsonl",
                           progress=False)
    stored = [json.loads(line) for line in (tmp_path / "q.jsonl").read_text().splitlines()]
    quest = next(r for r in stored if r["policy"] == "quest(page_size=8)")
    assert quest["policy_config"]["page_size"] == 8 and len(rows) == 2
    assert quest["retriever_config"] == {"name": "quest", "multi_token": "dense", "page_size": 8, "pages": None,
                                         "gqa": "head", "rule": "eval"}


# --- 6. a policy without a retriever never pays for the archive -----------------------------------------


def test_a_decode_step_without_a_retriever_does_the_same_work_at_any_archive_size(tiny):
    """The op count of a streaming_llm decode step (an archive kept, no retriever reading it) is the same with 100
    and with 2,000 archived rows."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.ops.append((str(func.overloadpacket), tuple(out.shape) if isinstance(out, torch.Tensor) else None))
            return out

    counts = []
    for n in (140, 2040):
        cache = TieredCache(tiny, registry.get("streaming_llm", budget=40, archive=True))
        with torch.no_grad():
            tiny(input_ids=_ids(n, seed=6), cache=cache, use_cache=True)
            with Count() as counter:
                tiny(input_ids=_ids(1, seed=7), cache=cache, use_cache=True)
        assert cache.stats().layers[0].archived_rows == n + 1 - 40
        counts.append([op for op, shape in counter.ops if shape is None or all(d < 100 for d in shape)])
    assert counts[0] == counts[1] and len(counts[0]) > 0


# --- 7. never silently uncompressed ---------------------------------------------------------------------------


def test_a_cache_used_by_another_model_refuses():
    first, second = tiny_llama(seed=0)[0], tiny_llama(seed=1)[0]
    cache = TieredCache(first, registry.get("streaming_llm", budget=32))
    with pytest.raises(RuntimeError, match="belongs to the model it was created for"):
        second(input_ids=_ids(50), cache=cache, use_cache=True)


@pytest.mark.parametrize("name", ["snapkv", "chunkkv", "vestige"])
def test_context_end_policies_compress_inside_model_generate(tiny, name):
    """model.generate never calls compress(): the cache compresses the prompt at the first decode step."""
    params = {"budget": 40, "window": 16} if name != "vestige" else {"budget": 40, "retriever": None}
    cache = TieredCache(tiny, registry.get(name, **params))
    tiny.generate(_ids(300, seed=8), max_new_tokens=6, min_new_tokens=6, do_sample=False, cache=cache, pad_token_id=0)
    for s in cache.stats().layers:
        assert s.events >= 1 and s.resident_rows == 40 + 5  # the compressed prompt + the rows decoded after it
    assert cache.stats().notes == []

def test_mla_cache_refuses_another_model_too():
    first, second = tiny_deepseek_v2(seed=0)[0], tiny_deepseek_v2(seed=1)[0]
    cache = TieredCache(first, registry.get("full"))
    with pytest.raises(RuntimeError, match="belongs to the model it was created for"):
        second(input_ids=_ids(20, vocab=512), cache=cache, use_cache=True)


# --- 8. the bad-input matrix: tests/reliability/test_bad_inputs.py ------------------------------------------


# --- 9. the trainer loads only tensors, from a per-user directory ------------------------------------------


def test_the_trainer_resumes_with_weights_only_from_a_per_user_directory(tmp_path, monkeypatch):
    from kvzoo.refmodel import train as trainer

    monkeypatch.delenv("KVZOO_CACHE_DIR", raising=False)
    assert trainer.TrainConfig(arm="nope").work_dir == str(pathlib.Path.home() / ".cache" / "kvzoo" / "train")
    source = pathlib.Path(trainer.__file__).read_text()
    assert "weights_only=True" in source and "weights_only=False" not in source
    # a state file holding an arbitrary object is refused on resume
    work = tmp_path / "nope-s0"
    work.mkdir()
    torch.save({"model": {}, "evil": pathlib.Path("/")}, work / "state.pt")
    cfg = trainer.TrainConfig(arm="nope", work_dir=str(tmp_path), max_steps=1, progress=False, threads=1)
    with pytest.raises(Exception, match="[Ww]eights only load failed|Unsupported global"):
        trainer.train(cfg)


def test_a_forward_that_failed_midway_does_not_poison_the_next_one_with_another_cache(tiny):
    """A cache's layer whose update ran but whose attention never did (a forward that raised in between) must not
    make a later forward of the same model, with a transformers cache, fail in kvzoo's attention."""
    from transformers import DynamicCache

    ids = torch.randint(1, 256, (1, 12), generator=torch.Generator().manual_seed(0))
    cache = TieredCache(tiny, "full")
    layer = cache.tiered_layers[0]
    layer.update(torch.zeros(1, 2, 5, 16), torch.zeros(1, 2, 5, 16))  # the rows went in; the attention never ran
    with torch.no_grad():
        plain = tiny(input_ids=ids, cache=DynamicCache(), use_cache=True).logits
        again = tiny(input_ids=ids, cache=DynamicCache(), use_cache=True).logits
    torch.testing.assert_close(plain, again, rtol=1e-6, atol=1e-6)  # two forwards: equal to rounding
