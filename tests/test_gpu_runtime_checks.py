"""What a runtime row of ``make gpu-check`` checks and counts, on CPU at toy size (``benchmarks/gpu_runtime.py``).

The (torch, eager) row is held to a float64 recomputation of every decode-attention call of its last warm-up step;
graph rows off CUDA run on the strict stand-in, which refuses a captured step that syncs or builds a host tensor;
every decode row records the counts the plan's cost model reads.
"""

from __future__ import annotations

import dataclasses
import gc
import sys
import types
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from kvzoo.bench.step_trace import CaptureError, StandInGraph

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import gpu_runtime  # noqa: E402


@pytest.fixture(autouse=True)
def _restore(monkeypatch):
    """The bench writes ``KVZOO_KERNELS`` into ``os.environ``: put back after each test (as tests/test_gpu_check.py
    does); the caches' cycles collected, ``ACTIVE_LAYER`` cleared."""
    monkeypatch.setenv("KVZOO_KERNELS", "auto")
    yield
    from kvzoo.framework.layer import ACTIVE_LAYER

    ACTIVE_LAYER.set(None)
    gc.collect()


def _cell(policy: str, mode: str = "eager", batch: int = 1, kernels: str = "torch") -> dict:
    return {"policy": policy, "kernels": kernels, "mode": mode, "context": 512, "batch": batch}


def test_the_reference_row_is_checked_against_float64_attention_and_fails_when_attention_is_off(monkeypatch):
    from kvzoo.framework import attention
    from kvzoo.kernels.decode_attention import sdpa

    original = attention.attend
    bench = gpu_runtime.RuntimeBench("cpu", toy=True)
    try:
        full = bench.decode_cell(_cell("full"))
        check = full["check"]
        assert full["status"] == "ok" and check["ok"], full.get("error")
        assert check["reference"] == "float64 attention on this row's inputs" and check["tolerance"] == 1e-5
        assert check["calls"] == len(check["rel"]) == bench.s.layers and 0 <= max(check["rel"]) <= 1e-5
        # two parts a layer: the tier deferred (no output of its own), then the fetched rows with it as the prior
        sketch = bench.decode_cell(_cell("vestige+sketch"))
        assert sketch["status"] == "ok" and sketch["check"]["ok"], sketch.get("error")
        assert sketch["check"]["calls"] == 2 * len(sketch["check"]["rel"]) == 2 * bench.s.layers
        assert attention.attend is original  # wrapped for the checked step only

        real = sdpa.attend_sdpa

        def off(*args, **kwargs):
            part = real(*args, **kwargs)
            return part if part.out is None else dataclasses.replace(part, out=part.out + 0.1)

        monkeypatch.setattr(sdpa, "attend_sdpa", off)
        for policy in ("full", "vestige+sketch"):
            row = bench.decode_cell(_cell(policy))
            assert row["status"] == "failed" and not row["check"]["ok"], policy
            assert "attention off its float64 reference" in row["error"] and max(row["check"]["rel"]) > 1e-3
    finally:
        bench.close()
    assert attention.attend is original


def test_the_strict_stand_in_refuses_a_captured_step_that_syncs_or_builds_a_host_tensor():
    cache = types.SimpleNamespace(graph=None)
    x = torch.arange(4.0)
    with pytest.raises(CaptureError, match=r"wait for the device \['_local_scalar_dense'\]"):
        StandInGraph(cache, strict=True).capture(lambda: {"logits": x * x.sum().item()})
    with pytest.raises(CaptureError, match=r"tensors built from host data, shapes \[\(2,\)\]"):
        StandInGraph(cache, strict=True).capture(lambda: {"logits": x[:2] + torch.tensor([1.0, 2.0])})
    assert issubclass(CaptureError, RuntimeError)
    clean = StandInGraph(cache, strict=True)
    assert torch.equal(clean.capture(lambda: {"logits": x * 2})["logits"], x * 2)
    assert StandInGraph(cache).capture(lambda: {"logits": x * x.sum().item()})["logits"][1] == 6.0  # not strict


@pytest.mark.parametrize("policy", ["vestige+sketch", "quest"])
def test_a_toy_graph_row_on_cpu_captures_strictly_and_replays_every_timed_step(policy):
    bench = gpu_runtime.RuntimeBench("cpu", toy=True)
    assert bench.graph_runner.func is StandInGraph and bench.graph_runner.keywords == {"strict": True}
    try:
        row = bench.decode_cell(_cell(policy, "graph", batch=2))
        assert row["status"] == "ok", row.get("error")
        assert row["replays"] == row["steps"] == bench.s.steps and row["captures"] >= 1
        assert row["check"]["ok"] and row["check"]["steps"] == bench.s.warmup
    finally:
        bench.close()


def test_every_decode_row_counts_layers_and_launches_and_no_timed_step_is_traced(monkeypatch):
    bench = gpu_runtime.RuntimeBench("cpu", toy=True)
    traced = []  # (the step's position, whether a dispatch mode -- StepTrace -- was active)
    step = bench._step

    def watched(net, cache, token, position):
        traced.append((position, _get_current_dispatch_mode() is not None))
        return step(net, cache, token, position)

    monkeypatch.setattr(bench, "_step", watched)
    try:
        rows = [bench.decode_cell(_cell(policy, mode)) for policy, mode in
                (("full", "eager"), ("transformers", "eager"), ("vestige+sketch", "capacity"), ("quest", "graph"))]
    finally:
        bench.close()
    for row in rows:
        assert row["status"] == "ok", row.get("error")
        assert row["layers"] == bench.s.layers and row["step_launches"] > 0 and row["setup_launches"] > 0, row
    by = {r["policy"]: r for r in rows}
    # a retrieving step launches more than a plain one; a transplant and compression more than a copy
    assert by["vestige+sketch"]["step_launches"] > by["full"]["step_launches"]
    assert by["full"]["setup_launches"] > by["transformers"]["setup_launches"]
    # the first warm-up step (position 512) of each run is traced, no other (the timed steps come after the warm-up)
    assert len(traced) == 4 * (bench.s.warmup + bench.s.steps) + 2 * bench.s.warmup  # + two references' warm-ups
    assert all(on == (position == 512) for position, on in traced), traced
