"""Progress within a run: the pipeline's steps say which phase they are in (prefill chunk k/n and its layers,
compress, question, decode t/T, teacher-forced t/T), to whatever reporter ``pipeline.reporting`` set -- and
nothing without one; the leaderboard shows each trial's phases under its bar of trials."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from kvzoo import pipeline, registry
from kvzoo.bench import runner


class Recorder(pipeline.Progress):
    """A Progress that records what it is told (and draws nowhere)."""

    def __init__(self, label: str = "", **_: object) -> None:
        super().__init__(label, disable=True)
        self.events: list[tuple] = []
        self.labels: list[str] = []

    def phase(self, name: str, total: int | None = None, unit: str = "steps") -> None:
        super().phase(name, total, unit)
        self.events.append(("phase", name, total, unit))

    def advance(self, n: int = 1) -> None:
        super().advance(n)
        self.events.append(("advance", n))

    def relabel(self, label: str) -> None:
        super().relabel(label)
        self.labels.append(label)

    def phases(self) -> list[str]:
        return [e[1] for e in self.events if e[0] == "phase"]

    def advances_in(self, name: str) -> int:
        """How many ``advance`` calls followed the (last) phase called ``name``, before the next phase."""
        count, inside = 0, False
        for event in self.events:
            if event[0] == "phase":
                inside, count = event[1] == name, 0 if event[1] == name else count
            elif inside:
                count += event[1]
        return count


def test_generate_reports_each_phase_and_counts_layers_and_tokens(tiny):
    recorder = Recorder()
    ids = list(range(5, 205))
    with pipeline.reporting(recorder):
        result = pipeline.generate(tiny, None, ids, [7, 8, 9], registry.get("h2o", budget=64),
                                   max_new_tokens=6, chunk_size=64)
    layers = tiny.config.num_hidden_layers
    assert recorder.phases() == ["prefill chunk 1/4", "prefill chunk 2/4", "prefill chunk 3/4", "prefill chunk 4/4",
                                 "compress", "question chunk 1/1", "decode"]
    assert [e[2:] for e in recorder.events if e[0] == "phase" and "chunk" in e[1]] == [(layers, "layers")] * 5
    assert recorder.advances_in("prefill chunk 4/4") == layers  # one tick per decoder layer of the forward
    assert recorder.advances_in("decode") == len(result.token_ids)
    assert ("phase", "decode", 6, "tokens") in recorder.events


def test_teacher_forcing_reports_its_own_phase_name(tiny):
    recorder = Recorder()
    with pipeline.reporting(recorder):
        pipeline.score(tiny, None, list(range(5, 105)), [7, 8], [11, 12, 13, 14], "full", mode="decode")
    assert recorder.phases()[-2:] == ["teacher-forced: lead chunk 1/1", "teacher-forced, one decode step per token"]
    assert recorder.advances_in("teacher-forced, one decode step per token") == 3  # 4 tokens: 3 decode steps


def test_nothing_is_reported_or_hooked_without_a_reporter(tiny):
    result = pipeline.generate(tiny, None, list(range(5, 105)), [7, 8], "full", max_new_tokens=2)
    assert result.answer == ""  # ran; and no forward hook was left behind on the layers
    assert all(not layer._forward_hooks for layer in pipeline._decoder_layers(tiny))


def test_progress_true_draws_a_bar_of_its_own(tiny, monkeypatch: pytest.MonkeyPatch):
    made: list[Recorder] = []
    monkeypatch.setattr(pipeline, "Progress", lambda label="", **kw: made.append(Recorder(label)) or made[-1])
    pipeline.generate(tiny, None, list(range(5, 105)), [7, 8], "full", max_new_tokens=2, progress=True)
    assert len(made) == 1 and made[0].phases()[0] == "prefill chunk 1/1"


def test_a_bar_on_a_file_shows_the_phase_and_counts():
    out = io.StringIO()
    bar = pipeline.Progress("vestige 4x", disable=False, file=out)
    bar.phase("decode", 3, "tokens")
    bar.advance()
    bar.bar.refresh()
    bar.close()
    assert "vestige 4x | decode: 1/3 tokens" in out.getvalue()


def test_the_leaderboard_shows_each_trials_phases(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    made: list[Recorder] = []
    monkeypatch.setattr(pipeline, "Progress", lambda label="", **kw: made.append(Recorder(label)) or made[-1])
    grid = runner.needle_grid(models=("tiny-llama",), context_tokens=(256,), ratios=(2,), positions=("after",),
                              policies=("full", "snapkv"), max_new_tokens=2, continuation_tokens=4)
    rows = runner.run_grid(grid, tmp_path / "r.jsonl", progress=True)
    assert [r["status"] for r in rows] == ["ok", "ok"]
    (recorder,) = made
    assert recorder.labels == [r["policy"] + ("" if r["ratio"] is None else f" {r['ratio']:g}x") + " niah_single d=0.5 q-after"
                               for r in rows]
    phases = recorder.phases()
    assert phases[0] == "loading tiny-llama"
    for name in ("shared prefill (dense) chunk 1/1", "compress", "answer NLL, one decode step per token",
                 "continuation CE, one decode step per token", "question chunk 1/1", "decode"):
        assert name in phases, name


def test_no_progress_makes_no_phase_bar(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    made: list[Recorder] = []
    monkeypatch.setattr(pipeline, "Progress", lambda label="", **kw: made.append(Recorder(label)) or made[-1])
    grid = runner.needle_grid(models=("tiny-llama",), context_tokens=(256,), ratios=(2,), policies=("full",),
                              max_new_tokens=2, continuation_tokens=0)
    runner.run_grid(grid, tmp_path / "r.jsonl", progress=False)
    assert made == []

