"""Issue 22, finding 3: a Ray run never waits forever for a worker the cluster cannot place. The cluster's
resources are checked before any worker starts (a GPU asked of a cluster without one is refused at once), and a
worker that cannot be placed within ``placement_timeout`` (its CPUs held by others) is given up, naming the
resource: the run goes on with the workers that started, or stops when none did. Timeouts here are seconds."""

from __future__ import annotations

from typing import Any

import pytest

from kvzoo.bench.executors import TrialGroup, Work
from kvzoo.bench.ray_executor import RayExecutor, RayUnavailable
from kvzoo.cli import main


class _Trial:
    def __init__(self, key: str) -> None:
        self.key, self.model, self.label = key, "m", key


class Echo:  # the runner a worker holds: shipped by value
    def run(self, trial, reference):
        return {"key": trial.key, "status": "ok"}


class SlowEcho(Echo):
    """A runner whose trials take a second each: the grid outlasts a 2 s placement timeout on one worker (an Echo
    grid can finish before it, and then no worker is ever given up -- once a worker's start-up became quick, when
    importing kvzoo.bench stopped importing transformers, that race was lost on an idle machine)."""

    def run(self, trial, reference):
        import time

        time.sleep(1.0)
        return super().run(trial, reference)


def _work(*keys: str, runner: type = Echo) -> Work:
    group = TrialGroup("g", "m", [_Trial(k) for k in keys], first_is_reference=True)
    return Work(groups=[group], make_runner=runner, reference=lambda trial: None,
                failed_row=lambda trial, cause: {"key": trial.key, "status": "error", "error": cause})


@pytest.fixture
def cpus_held(ray_cluster):
    """Hold ``n`` of the cluster's 2 CPUs in an actor of another job, as a busy cluster would."""
    held = []

    def hold(n: int) -> None:
        holder = ray_cluster.remote(num_cpus=n)(type("Holder", (), {"ping": lambda self: "ok"}))
        actor = holder.remote()
        assert ray_cluster.get(actor.ping.remote(), timeout=120) == "ok"
        held.append(actor)

    yield hold
    for actor in held:
        ray_cluster.kill(actor)


def test_a_gpu_per_worker_on_a_cluster_without_gpus_is_refused_at_once_naming_the_resource(ray_cluster, tmp_path,
                                                                                           capsys):
    out = tmp_path / "r.jsonl"
    code = main(["leaderboard", "--preset", "tiny", "--policies", "full", "--no-plots", "--no-progress", "--out",
                 str(out), "--executor", "ray", "--workers", "1", "--gpus-per-worker", "1"])
    assert code == 2
    err = capsys.readouterr().err
    assert "the cluster has 0 GPUs in all: not enough for one worker at gpus_per_worker=1" in err
    assert "leave out --gpus-per-worker" in err and not out.exists()  # nothing written, not even an empty file


def test_a_worker_the_cluster_cannot_place_times_out_naming_the_resource(ray_cluster, cpus_held):
    cpus_held(2)  # every CPU of the cluster is taken
    emitted: list[Any] = []
    executor = RayExecutor(workers=1, placement_timeout=2)
    with pytest.raises(RayUnavailable, match=r"ray worker 0 could not be placed on the Ray cluster within 2 s: each "
                                             r"needs 1 CPU \(free now: 0 of 2\).*--placement-timeout"):
        executor.run(_work("ref", "a"), lambda trial, row, info: emitted.append(trial.key))
    assert emitted == []


def test_workers_that_cannot_be_placed_are_given_up_and_the_others_finish_the_grid(ray_cluster, cpus_held, capsys):
    cpus_held(1)  # one CPU left: one of the two workers fits
    emitted: list[str] = []
    RayExecutor(workers=2, placement_timeout=2).run(_work("ref", "a", "b", runner=SlowEcho),
                                                    lambda trial, row, info: emitted.append(row["key"]))
    assert sorted(emitted) == ["a", "b", "ref"] and emitted[0] == "ref"  # every trial once, the reference first
    err = capsys.readouterr().err
    assert "could not be placed on the Ray cluster within 2 s" in err and "going on with the 1 worker(s)" in err
