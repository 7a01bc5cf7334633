"""kvzoo.bench.runner, report and plots: faithful trials, the grid, resuming, plugins, skipped policies."""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import pytest
import torch

from kvzoo import TieredCache, pipeline, registry
from kvzoo.bench import plots, report, runner
from kvzoo.bench.tasks import ByteTokenizer, TaskSpec, make_task
from kvzoo.framework.policy import Policy, RowsView
from kvzoo.policies.streaming_llm import StreamingLLM

TESTS_DIR = Path(__file__).parent
BYTES = ByteTokenizer()
TINY_TASK = TaskSpec("niah_single", 384, 0.5)


pytestmark = pytest.mark.usefixtures("clean_registry")  # tests/conftest.py


def tiny_grid(**fields) -> runner.Grid:
    base = dict(models=("tiny-llama",), policies=("full", "streaming_llm"), ratios=(2,), tasks=(TINY_TASK,),
                positions=("after",), max_new_tokens=4, continuation_tokens=16)
    base.update(fields)
    return runner.Grid(**base)


def register(*classes: type[Policy]) -> None:
    @registry.hookimpl
    def kvzoo_policies():
        return list(classes)

    registry.register_plugin(types.SimpleNamespace(kvzoo_policies=kvzoo_policies), name=f"test-{classes[0].name}")


# --- one trial is what the pipeline would do -----------------------------------------------------


@pytest.mark.parametrize("name", list(registry.available()))
@pytest.mark.parametrize("position", ["after", "before"])
def test_trial_on_a_forked_cache_equals_pipeline_generate_and_score(tiny, name: str, position: str):
    """The trial prefills once and forks; pipeline.generate and pipeline.score each prefill on their own."""
    task = make_task(TINY_TASK, BYTES, continuation_tokens=16)
    ids = runner.encode_prompt(BYTES, task)

    def policy():
        return registry.get(name) if not runner.needs_ratio(name) else registry.get(name, ratio=2)

    row = runner.run_trial(tiny, BYTES, task, policy(), position=position, max_new_tokens=6, stop_when_answered=False)
    generated = pipeline.generate(tiny, None, ids.prefix, ids.question, policy(), max_new_tokens=6,
                                  question_position=position)
    scored = pipeline.score(tiny, None, ids.prefix, ids.question, ids.answer, policy(), question_position=position,
                            mode="decode")
    one_forward = pipeline.score(tiny, None, ids.prefix, ids.question, ids.answer, policy(),
                                 question_position=position)
    assert row["prediction"] == BYTES.decode(generated.token_ids)
    assert row["teacher_forcing"] == "decode"
    assert row["answer_nll"] == pytest.approx(scored.nll, abs=1e-4)
    assert row["answer_nll_one_forward"] == pytest.approx(one_forward.nll, abs=1e-4)
    assert row["answer_tokens"] == scored.answer_tokens
    totals = generated.stats.totals
    assert row["peak_resident_rows"] == totals["peak_resident_rows"]
    if position == "after":
        assert row["continuation_tokens"] == ids.continuation.shape[1]
        for mode, key in (("decode", "continuation_ce"), ("one_forward", "continuation_ce_one_forward")):
            expected = pipeline.continuation_nll(tiny, ids.prefix, ids.continuation, policy(), mode=mode).ce
            assert row[key] == pytest.approx(expected, abs=1e-4)
    else:
        assert row["continuation_ce"] is None and row["continuation_ce_one_forward"] is None


def test_forked_cache_shares_the_model_and_copies_the_rows(tiny):
    task = make_task(TINY_TASK, BYTES)
    ids = runner.encode_prompt(BYTES, task)
    cache = TieredCache(tiny, registry.get("streaming_llm", ratio=2), context_length=ids.prefix.shape[1])
    with torch.no_grad():
        tiny(input_ids=ids.prefix, cache=cache, use_cache=True, logits_to_keep=1)
    cache.compress()
    fork = cache.fork()
    layer, copy = cache.tiered_layers[0], fork.tiered_layers[0]
    assert torch.equal(layer.keys, copy.keys)
    assert layer.store.rows.buffers["keys"].data_ptr() != copy.store.rows.buffers["keys"].data_ptr()
    assert fork.policy == cache.policy and fork.runtime is not cache.runtime and fork.runtime.shared is not cache.runtime.shared
    with torch.no_grad():
        tiny(input_ids=ids.question[:, :3], cache=fork, use_cache=True, logits_to_keep=1)
    assert layer.counts.seen == ids.prefix.shape[1] and copy.counts.seen == ids.prefix.shape[1] + 3


def test_forked_mla_cache_keeps_the_models_attention_modules():
    from kvzoo.models import tiny_deepseek_v2

    model, _ = tiny_deepseek_v2()
    cache = TieredCache(model, registry.get("full"), context_length=16)
    fork = cache.fork()
    modules = cache.adapter.attention_modules()
    assert modules and all(fork.adapter.attention_modules()[i] is m for i, m in modules.items())


# --- the grid ------------------------------------------------------------------------------------


def test_plan_puts_the_reference_first_and_runs_it_without_a_ratio():
    grid = tiny_grid(ratios=(2, 4), positions=("after", "before"), policies=None)
    trials = runner.plan(grid)
    names = list(registry.available()) + list(runner.registered_variants())  # quest(gqa=group) runs beside quest
    per_position = 1 + 2 * (len(names) - 1)  # full once, every other policy at two ratios
    assert len(trials) == 2 * per_position
    assert trials[0].policy == "full" and trials[0].ratio is None and trials[0].position == "after"
    assert trials[per_position].policy == "full" and trials[per_position].position == "before"
    assert len({t.key for t in trials}) == len(trials)


def test_a_spec_that_fixes_its_budget_runs_once_per_task_whatever_the_grids_ratios():
    grid = tiny_grid(ratios=(2, 4), positions=("after",), policies=("full", "snapkv", "snapkv(budget=64)",
                                                                    "chunkkv(ratio=8)"))
    got = [(t.policy, t.ratio) for t in runner.plan(grid)]
    assert got == [("full", None), ("snapkv", 2), ("snapkv", 4), ("snapkv(budget=64)", None),
                   ("chunkkv(ratio=8)", None)]
    assert runner.build_policy("snapkv(budget=64)", None).budget == 64


def test_plan_rejects_unknown_policies_and_models_naming_the_valid_ones():
    with pytest.raises(ValueError, match="registered policies: full, streaming_llm"):
        runner.plan(tiny_grid(policies=("full", "streamingllm")))
    with pytest.raises(ValueError, match="valid names are smollm2-135m, gemma3-270m, tiny-llama"):
        runner.plan(tiny_grid(models=("no-such-model",)))
    with pytest.raises(ValueError, match="ratios must be numbers >= 1"):
        tiny_grid(ratios=(0.5,))


def test_tiny_leaderboard_end_to_end_writes_table_and_png(tmp_path: Path):
    results = tmp_path / "tiny.jsonl"
    rows = runner.run_grid(tiny_grid(), results, progress=False)
    assert [(r["policy"], r["ratio"], r["status"]) for r in rows] == [("full", None, "ok"), ("streaming_llm", 2.0, "ok")]
    lines = results.read_text().splitlines()
    assert len(lines) == 2
    stored = json.loads(lines[1])
    assert stored["policy_config"] == {**StreamingLLM(ratio=2.0).config()}
    assert set(stored["versions"]) >= {"kvzoo", "torch", "transformers", "python"}
    assert stored["delta_nll"] == pytest.approx(stored["answer_nll"] - stored["full_answer_nll"])
    full = json.loads(lines[0])
    assert full["delta_nll"] == 0.0 and full["intact"] is True and full["delta_ce"] == 0.0

    table = report.leaderboard_table(rows)
    assert table.splitlines()[0] == "| policy | 2x q after | 2x q before | 2x KV bytes/token |"
    assert table.splitlines()[2].startswith("| full (reference) | ")
    assert table.splitlines()[3].startswith("| streaming_llm | ")
    assert "n/a" in table.splitlines()[3]  # no question-before trials
    text = report.render(rows)
    assert "intact rate" in text and "tiny-llama" in text

    written = plots.write_plots(rows, tmp_path, prefix="tiny-")
    assert [p.name for p in written] == ["tiny-needle-heatmap.png", "tiny-score-vs-ratio.png", "tiny-frontier.png"]
    for path in written:
        assert path.stat().st_size > 0 and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_interrupted_run_resumes_without_redoing_finished_trials(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    results = tmp_path / "resume.jsonl"
    grid = tiny_grid(ratios=(2, 4))  # 3 trials: full, streaming_llm 2x, streaming_llm 4x
    real_run_trial = runner.run_trial
    calls: list[str] = []

    def interrupted_after_one(model, tokenizer, task, policy, **kw):
        if calls:
            raise KeyboardInterrupt
        calls.append(policy.name)
        return real_run_trial(model, tokenizer, task, policy, **kw)

    monkeypatch.setattr(runner, "run_trial", interrupted_after_one)
    with pytest.raises(KeyboardInterrupt):
        runner.run_grid(grid, results, progress=False)
    assert len(results.read_text().splitlines()) == 1
    with results.open("a") as fh:  # an interruption in the middle of a write
        fh.write('{"key": "tiny-llama|cut sho')

    def counting(model, tokenizer, task, policy, **kw):
        calls.append(f"{policy.name} {policy.ratio}")
        return real_run_trial(model, tokenizer, task, policy, **kw)

    monkeypatch.setattr(runner, "run_trial", counting)
    rows = runner.run_grid(grid, results, progress=False)
    assert calls == ["full", "streaming_llm 2.0", "streaming_llm 4.0"]
    assert [r["status"] for r in rows] == ["ok", "ok", "ok"]
    assert all(r["delta_nll"] is not None for r in rows)  # the reference was read back from the file
    assert len(runner.read_results(results)) == 3
    calls.clear()
    runner.run_grid(grid, results, progress=False)
    assert calls == []  # everything finished: nothing runs again


# --- policies from the registry ------------------------------------------------------------------


def test_entry_point_plugin_appears_in_the_leaderboard(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       request: pytest.FixtureRequest):
    """A third-party policy installed through the ``kvzoo`` entry-point group joins the grid with no code change."""
    module = "kvzoo_bench_keep_first_plugin"
    shutil.copy(TESTS_DIR / "plugin_example.py", tmp_path / f"{module}.py")
    dist_info = tmp_path / "kvzoo_bench_keep_first-0.1.0.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: kvzoo-bench-keep-first\nVersion: 0.1.0\n")
    (dist_info / "entry_points.txt").write_text(f"[kvzoo]\nkeep_first = {module}\n")
    request.addfinalizer(lambda: sys.modules.pop(module, None))
    monkeypatch.syspath_prepend(str(tmp_path))
    registry.reload()

    rows = runner.run_grid(tiny_grid(policies=None, positions=("after",)), tmp_path / "plugin.jsonl", progress=False)
    assert [r["policy"] for r in rows] == list(registry.available()) + list(runner.registered_variants())
    keep_first = [r for r in rows if r["policy"] == "keep_first"]
    assert [r["status"] for r in keep_first] == ["ok"]
    assert keep_first[0]["policy_config"]["name"] == "keep_first"
    assert any(line.startswith("| keep_first | ") for line in report.leaderboard_table(rows).splitlines())


@dataclass
class CappedRatio(Policy):
    """Refuses ratios above 3 (like a policy whose pages cannot fit a small budget)."""

    name: ClassVar[str] = "capped_ratio"
    summary: ClassVar[str] = "test: refuses high ratios"

    def validate(self) -> None:
        super().validate()
        if self.ratio is not None and self.ratio > 3:
            raise ValueError(f"ratio must be <= 3 for capped_ratio, got {self.ratio}")

    def priority(self, rows: RowsView, keep: int) -> torch.Tensor:
        return torch.arange(rows.num_rows, dtype=torch.float32).expand(rows.valid.shape)  # the latest rows stay


@dataclass
class Broken(CappedRatio):
    name: ClassVar[str] = "broken"
    summary: ClassVar[str] = "test: fails at compression"

    def priority(self, rows: RowsView, keep: int) -> torch.Tensor:
        raise RuntimeError("selector exploded")


def test_refused_ratio_is_skipped_and_a_failing_policy_is_an_error_not_a_crash(tmp_path: Path):
    register(CappedRatio, Broken)
    grid = tiny_grid(policies=("full", "capped_ratio", "broken"), ratios=(2, 4))
    rows = runner.run_grid(grid, tmp_path / "skips.jsonl", progress=False)
    status = {(r["policy"], r["ratio"]): r["status"] for r in rows}
    assert status == {("full", None): "ok", ("capped_ratio", 2.0): "ok", ("capped_ratio", 4.0): "skipped",
                      ("broken", 2.0): "error", ("broken", 4.0): "skipped"}
    skipped = next(r for r in rows if r["policy"] == "capped_ratio" and r["status"] == "skipped")
    assert "ratio must be <= 3" in skipped["error"]
    error = next(r for r in rows if r["policy"] == "broken" and r["status"] == "error")
    assert error["error"] == ("PluginError: policy 'broken' (tests.test_bench_runner.Broken): priority() raised "
                              "RuntimeError: selector exploded")  # the plugin named (issue 44 item 11)
    table = report.leaderboard_table(rows).splitlines()
    assert table[3].startswith("| capped_ratio | ") and "| skipped |" in table[3]
    assert "| error |" in table[4]
    assert any("capped_ratio 4x: skipped: ValueError: ratio must be <= 3" in p for p in report.problems(rows))
    # skipped and failed trials are tried again on the next run; finished ones are not
    again = runner.run_grid(grid, tmp_path / "skips.jsonl", progress=False)
    assert [r["finished_at"] for r in again if r["status"] == "ok"] == [r["finished_at"] for r in rows if r["status"] == "ok"]


def _row(key: str) -> dict:
    """The fields a kvzoo row needs to count as one (runner.row_problem)."""
    return {"key": key, "status": "ok", "model": "m", "policy": "full", "task": "niah_single",
            "question_position": "after", "ratio": None, "answer_nll": 1.0, "score": 1.0}


def test_a_cut_line_is_skipped_reported_and_kept_and_the_next_row_starts_clean(tmp_path: Path):
    path = tmp_path / "r.jsonl"
    text = json.dumps(_row("a")) + '\n{"key": "b", "sta'
    path.write_text(text)
    found = runner.read_results_file(path)
    assert [r["key"] for r in found.rows] == ["a"]
    assert found.problems() == [f"{path}:2: not JSON (Unterminated string starting at) (skipped; the line stays in the file)"]
    assert path.read_text() == text  # reading never writes
    runner.append_row(path, _row("c"))
    assert path.read_text().splitlines()[-1] == json.dumps(_row("c"))
    assert [r["key"] for r in runner.read_results(path)] == ["a", "c"]
    assert runner.read_results(tmp_path / "missing.jsonl") == []


def test_detail_table_reports_intact_rate_and_na_for_unreported_violations(tmp_path: Path):
    rows = runner.run_grid(tiny_grid(one_forward=True), tmp_path / "d.jsonl", progress=False)
    detail = report.detail_table(rows).splitlines()
    assert detail[0].startswith("| policy | ratio | trials | intact rate |")
    assert "| ΔCE (one forward) |" in detail[0]
    assert detail[2].startswith("| full | — | 1 | 1.00 | +0.00 | +0.0000 | +0.0000 |")
    assert "| n/a |" in detail[3]  # no retrieval tier, no audit: bound violations not reported


def test_one_forward_figures_are_opt_in_and_a_grid_asking_for_them_reruns_rows_without(tmp_path: Path, capsys):
    path = tmp_path / "o.jsonl"
    rows = runner.run_grid(tiny_grid(), path, progress=False)  # default: decode steps only
    assert {r["status"] for r in rows} == {"ok"}
    for row in rows:
        assert row["answer_nll"] is not None and row["continuation_ce"] is not None
        for key in ("answer_nll_one_forward", "continuation_ce_one_forward", "delta_nll_one_forward",
                    "intact_one_forward", "delta_ce_one_forward", "full_continuation_ce_one_forward"):
            assert row[key] is None
    assert rows[1]["delta_ce"] is not None and rows[1]["intact"] is not None
    detail = report.detail_table(rows)
    assert "one forward" not in detail and "n/a | n/a | n/a | n/a" not in detail
    report.render(rows, title="t")  # the whole page renders from rows holding None there
    again = runner.run_grid(tiny_grid(one_forward=True), path, progress=False, estimate=True)  # runs both again
    assert all(r["answer_nll_one_forward"] is not None for r in again)
    assert again[1]["delta_ce_one_forward"] is not None
    for before, after in zip(rows, again, strict=True):  # the decode-step figures do not depend on the option
        assert after["key"] == before["key"]
        for key in ("answer_nll", "continuation_ce", "delta_nll", "delta_ce", "prediction"):
            assert after[key] == before[key]
    assert "estimated time" in capsys.readouterr().err
    assert len(runner.read_results(path)) == 4
    runner.run_grid(tiny_grid(), path, progress=False)  # rows with the figures finish a grid without them
    assert len(runner.read_results(path)) == 4
    with pytest.raises(ValueError, match="one_forward"):
        tiny_grid(one_forward=1)


def test_format_bytes():
    assert report.format_bytes(512) == "512 B"
    assert report.format_bytes(1536) == "1.5 KiB"
    assert report.format_bytes(11 * 2**20) == "11.0 MiB"
    assert report.format_bytes(None) == "n/a"


def test_grid_rows_record_task_and_settings(tmp_path: Path):
    grid = dataclasses.replace(tiny_grid(), policies=("full",))
    (row,) = runner.run_grid(grid, tmp_path / "s.jsonl", progress=False)
    assert {k: row[k] for k in ("task", "haystack", "context_tokens", "depth", "seed")} == TINY_TASK.as_dict()
    assert row["settings"]["max_new_tokens"] == 4 and row["question_position"] == "after"
    assert abs(row["context_tokens_actual"] - 384) <= 8


def test_demo_preset_is_the_small_grid_of_the_issue():
    grid = runner.PRESETS["demo"]()
    assert grid.models == ("smollm2-135m",) and grid.policies is None  # every registered policy at run time
    assert grid.ratios == (4.0, 8.0) and grid.positions == ("after",)
    assert [(s.task, s.context_tokens, s.depth) for s in grid.tasks] == [
        ("niah_single", 2000, 0.25), ("niah_single", 2000, 0.75)]
    # minutes, not half an hour: no held-out continuation (no ΔCE) and no configured variants in the main job
    assert grid.continuation_tokens == 0 and tuple(grid.variants) == ()
    trials = runner.plan(grid)
    assert len(trials) == 2 * (1 + 2 * (len(registry.available()) - 1))  # per depth: full, every other policy at 2 ratios
    assert runner.PRESETS["leaderboard"]().variants is None  # the larger grid keeps them: the registered ones
    assert runner.registered_variants() == ("quest(rule=kernel)", "quest(gqa=group)")


def test_leaderboard_hour_is_the_leaderboard_at_4x_and_8x_without_the_variants_and_the_one_forward_figures():
    full, hour = runner.PRESETS["leaderboard"](), runner.PRESETS["leaderboard-hour"]()
    assert hour.tasks == full.tasks and hour.positions == full.positions == ("after", "before")
    assert hour.continuation_tokens == full.continuation_tokens == 32  # ΔCE kept
    assert hour.ratios == (4.0, 8.0) and full.ratios == (2.0, 4.0, 8.0) and tuple(hour.variants) == ()
    assert not hour.one_forward and not full.one_forward  # opt-in: --one-forward
    assert len(runner.plan(full)) == 650
    assert len(runner.plan(hour)) == 2 * len(hour.tasks) * (1 + 2 * (len(registry.available()) - 1))


def test_render_json_turns_benchmark_json_into_the_same_table(tmp_path: Path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("render_json", TESTS_DIR.parent / "benchmarks" / "render_json.py")
    render_json = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(render_json)
    rows = runner.run_grid(tiny_grid(), tmp_path / "r.jsonl", progress=False)
    data = {"benchmarks": []}
    for row in rows:
        info = {"policy": row["policy"], "ratio": row["ratio"]}
        data["benchmarks"].append({"name": "test_prefill_compress[x]", "stats": {"mean": 0.5},
                                   "extra_info": {**info, "leaderboard_rows": [row]}})
        data["benchmarks"].append({"name": "test_decode_steps[x]", "stats": {"mean": 0.08},
                                   "extra_info": {**info, "decode_steps": 8}})
    from_json = render_json.rows_from_benchmark_json(json.loads(json.dumps(data)))
    assert report.leaderboard_table(from_json) == report.leaderboard_table(rows)
    assert all(r["prefill_s"] == 0.5 and r["decode_ms_per_step"] == pytest.approx(10.0) for r in from_json)


def test_a_row_that_ran_another_configuration_is_run_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys):
    """Resuming takes an ok row as finished only while the name still builds the configuration it recorded: a row
    whose ``policy_config`` or ``retriever_config`` differs (a default changed since) runs again, and says so."""
    results = tmp_path / "stale.jsonl"
    grid = tiny_grid(ratios=(2,))  # full and streaming_llm 2x
    runner.run_grid(grid, results, progress=False)
    rows = [json.loads(line) for line in results.read_text().splitlines()]
    stale = next(r for r in rows if r["policy"] == "streaming_llm")
    stale["policy_config"] = {**stale["policy_config"], "sinks": stale["policy_config"]["sinks"] + 1}
    results.write_text("".join(json.dumps(r) + "\n" for r in rows))
    calls: list[str] = []
    real_run_trial = runner.run_trial

    def counting(model, tokenizer, task, policy, **kw):
        calls.append(policy.name)
        return real_run_trial(model, tokenizer, task, policy, **kw)

    monkeypatch.setattr(runner, "run_trial", counting)
    capsys.readouterr()
    runner.run_grid(grid, results, progress=False)
    assert calls == ["streaming_llm"]  # full's row matches what "full" builds: not run again
    assert "its row ran with policy_config sinks=" in capsys.readouterr().err
    runner.run_grid(grid, results, progress=False)  # the new row records what ran: finished now
    assert calls == ["streaming_llm"]


def test_the_long_preset_is_gemma3_on_real_essays_at_8k_to_32k_with_vestige_at_64x_and_128x():
    from kvzoo.bench.planner import PRESETS

    grid = PRESETS["long"]()
    assert grid.models == ("gemma3-270m",) and grid.ratios == (8.0, 32.0) and grid.positions == ("after",)
    single = [t for t in grid.tasks if t.task == "niah_single"]
    assert {t.haystack for t in grid.tasks} == {"paul_graham"}
    assert {n: sum(t.context_tokens == n for t in single) for n in (8000, 16000, 32000)} == {8000: 10, 16000: 10,
                                                                                           32000: 10}
    assert {t.task for t in grid.tasks if t.context_tokens == 16000} == {"niah_single", "niah_multikey",
                                                                          "niah_multiturn"}
    assert set(grid.variants) == {"vestige(ratio=64)", "vestige(ratio=128)"}
