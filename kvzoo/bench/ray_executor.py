"""``RayExecutor``: a leaderboard's trials on a Ray cluster (``kvzoo leaderboard --executor ray``).

One actor per worker slot holds a :class:`~kvzoo.bench.runner.TrialRunner` -- so each worker
loads a model once, not once per trial -- and runs one trial at a time. The driver hands out trials
as workers free up (:class:`~kvzoo.bench.executors.TrialQueue`: a group's reference trial first,
then its other trials on any worker), and streams each row back to
:func:`~kvzoo.bench.runner.run_grid`, the only writer of the results file.

Faults: a worker process that dies under a trial (killed, out of memory, a node lost) is replaced
by a new actor, and the trial goes back to the queue for whichever worker is free next; after
``max_attempts`` lost workers it is recorded as an error naming the cause. A trial that fails in
Python (a policy's exception) is not a fault: its row says ``error``, as in a local run. Rows carry
``attempts`` and ``attempt_errors``.

Ray is imported only when a ``RayExecutor`` is made: ``pip install 'kvzoo[ray]'``.
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass
from typing import Any

from kvzoo.bench.executors import RAY_INSTALL, Emit, TrialGroup, TrialQueue, Work, timed_run

LOCAL_OBJECT_STORE_BYTES = 256 * 2**20  # a local instance's object store: rows are small, models never travel


class RayUnavailable(RuntimeError):
    """Ray is not installed, or the cluster named cannot be reached."""


def import_ray() -> Any:
    """The ``ray`` module, or :class:`RayUnavailable` saying how to install it."""
    try:
        import ray
    except ImportError as err:
        raise RayUnavailable(f"the ray executor needs Ray, which is not installed here ({err}): {RAY_INSTALL}") from None
    return ray


class TrialWorker:
    """The actor: a :class:`TrialRunner` built in the worker process, kept for every trial it runs."""

    def __init__(self, make_runner: Any, threads: int | None, device: str | None) -> None:
        self.runner = make_runner(device=device) if device else make_runner()
        torch = sys.modules.get("torch")  # the runner imported it (kvzoo's does): its threads = this worker's CPUs
        if threads and torch is not None:
            torch.set_num_threads(threads)

    def run(self, trial: Any, reference: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        return timed_run(self.runner, trial, reference)


@dataclass
class _Slot:
    index: int
    actor: Any = None
    name: str = ""
    busy: bool = False
    group_key: str | None = None
    model: str | None = None
    restarts: int = 0


def _cause(err: BaseException) -> str:
    """A worker fault in one line: the exception, its first line, and Ray's exit detail when it gives one."""
    text = str(err).strip()
    first = text.splitlines()[0] if text else ""
    detail = ""
    if "Worker exit detail:" in text:
        detail = text.split("Worker exit detail:", 1)[1].strip().split(". ")[0]
    cause = f"{type(err).__name__}: {first}" + (f" ({detail})" if detail else "")
    return cause if len(cause) <= 400 else cause[:397] + "..."


class RayExecutor:
    """Trials on Ray: ``workers`` actors, each ``cpus_per_worker`` CPUs and ``gpus_per_worker`` GPUs.

    ``address``: None starts a local Ray instance (or uses the one this process already started
    with ``ray.init``); ``"auto"`` joins the cluster of this machine (``ray start --head``);
    ``"ray://host:10001"`` a remote one through Ray Client. Every node needs kvzoo (the same version)
    and the model files it runs. ``workers=None``: as many as the cluster's CPUs (or GPUs, with
    ``gpus_per_worker``) allow. A worker with a GPU runs its model on ``cuda``.
    ``max_attempts``: how many workers a trial may lose before it is recorded as an error.
    """

    name = "ray"

    def __init__(
        self,
        address: str | None = None,
        workers: int | None = None,
        gpus_per_worker: float = 0.0,
        cpus_per_worker: float = 1.0,
        max_attempts: int = 3,
        object_store_memory: int | None = None,
    ) -> None:
        if address is not None and (not isinstance(address, str) or not address.strip()):
            raise ValueError(f"address must be None (start a local Ray), 'auto' or 'ray://host:port', got {address!r}")
        if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
            raise ValueError(f"workers must be an int >= 1 (or None: as many as the cluster allows), got {workers!r}")
        for label, value, low in (("gpus_per_worker", gpus_per_worker, 0.0), ("cpus_per_worker", cpus_per_worker, 1e-9)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= low:
                raise ValueError(f"{label} must be a number {'>= 0' if low == 0 else '> 0'}, got {value!r}")
        if isinstance(max_attempts, bool) or not isinstance(max_attempts, int) or max_attempts < 1:
            raise ValueError(f"max_attempts must be an int >= 1, got {max_attempts!r}")
        self.address = address
        self.workers = workers
        self.gpus_per_worker = float(gpus_per_worker)
        self.cpus_per_worker = float(cpus_per_worker)
        self.max_attempts = max_attempts
        self.object_store_memory = object_store_memory
        self.ray = import_ray()  # fail now, before a grid is planned, when Ray is missing

    def __repr__(self) -> str:
        return (f"RayExecutor(address={self.address!r}, workers={self.workers}, gpus_per_worker={self.gpus_per_worker:g}, "
                f"cpus_per_worker={self.cpus_per_worker:g}, max_attempts={self.max_attempts})")

    # --- the cluster ---------------------------------------------------------------------------------
    def _connect(self) -> bool:
        """Connect to (or start) Ray; True when this call started it (and so shuts it down)."""
        ray = self.ray
        if ray.is_initialized():
            return False
        if self.address is None:
            cpus = os.cpu_count() or 1
            if self.workers is not None:
                cpus = max(cpus, math.ceil(self.workers * self.cpus_per_worker))
            ray.init(address="local", num_cpus=cpus, include_dashboard=False, log_to_driver=False,
                     object_store_memory=self.object_store_memory or LOCAL_OBJECT_STORE_BYTES)
            return True
        try:
            ray.init(address=self.address, log_to_driver=False)
        except (ConnectionError, RuntimeError, ValueError) as err:
            raise RayUnavailable(
                f"could not connect to the Ray cluster at {self.address!r} ({type(err).__name__}: {err}). Start one "
                "with `ray start --head` on the head node (then --address auto there, or ray://HEAD:10001 from "
                "elsewhere), or leave out --address to start a local Ray instance"
            ) from err
        return True

    def _worker_count(self) -> int:
        if self.workers is not None:
            return self.workers
        resources = self.ray.cluster_resources()
        count = int(resources.get("CPU", 1) // self.cpus_per_worker)
        if self.gpus_per_worker:
            count = min(count, int(resources.get("GPU", 0) // self.gpus_per_worker))
            if count < 1:
                raise RayUnavailable(f"the cluster has {resources.get('GPU', 0):g} GPUs: not enough for one worker "
                                     f"at gpus_per_worker={self.gpus_per_worker:g}")
        return max(1, count)

    # --- running -------------------------------------------------------------------------------------
    def run(self, work: Work, emit: Emit) -> None:
        if not work.groups:
            return
        ray = self.ray
        started_here = self._connect()
        slots: list[_Slot] = []
        try:
            actor_class = ray.remote(num_cpus=self.cpus_per_worker, num_gpus=self.gpus_per_worker,
                                     max_restarts=0, max_task_retries=0)(TrialWorker)
            threads = max(1, int(self.cpus_per_worker))
            device = "cuda" if self.gpus_per_worker else None

            def start(slot: _Slot) -> None:
                slot.actor = actor_class.remote(work.make_runner, threads, device)
                slot.name = f"ray worker {slot.index}" + (f" (restart {slot.restarts})" if slot.restarts else "")
                slot.busy, slot.group_key, slot.model = False, None, None

            slots = [_Slot(i) for i in range(min(self._worker_count(), work.trial_count))]
            for slot in slots:
                start(slot)
            self._loop(work, emit, slots, start)
        finally:
            for slot in slots:
                try:
                    ray.kill(slot.actor, no_restart=True)
                except Exception:  # already dead, or the cluster went away: nothing left to stop
                    pass
            if started_here:
                ray.shutdown()

    def _loop(self, work: Work, emit: Emit, slots: list[_Slot], start: Any) -> None:
        ray = self.ray
        queue = TrialQueue(work.groups)
        in_flight: dict[Any, tuple[_Slot, TrialGroup, Any]] = {}
        lost: dict[str, list[str]] = {}  # trial key -> one cause per worker it lost

        def hand_out() -> None:
            for slot in slots:
                if slot.busy:
                    continue
                item = queue.take(slot.group_key, slot.model)
                if item is None:
                    return
                group, trial = item
                slot.busy, slot.group_key, slot.model = True, group.key, group.model
                in_flight[slot.actor.run.remote(trial, work.reference(trial))] = (slot, group, trial)
                if work.on_start is not None:
                    work.on_start(trial, slot.name)

        while len(queue) or in_flight:
            hand_out()
            if not in_flight:  # a group waits for a reference that nobody runs: a bug in TrialQueue
                raise RuntimeError(f"{len(queue)} trials are left but none can start")
            (ref,), _ = ray.wait(list(in_flight), num_returns=1)
            slot, group, trial = in_flight.pop(ref)
            slot.busy = False
            try:
                row, info = ray.get(ref)
            except ray.exceptions.RayError as err:  # the worker died (killed, out of memory, node lost)
                errors = lost.setdefault(trial.key, [])
                errors.append(f"{slot.name}: {_cause(err)}")
                try:
                    ray.kill(slot.actor, no_restart=True)
                except Exception:  # already gone
                    pass
                slot.restarts += 1
                start(slot)  # a new process in this slot; the trial goes to whichever worker is free first
                if len(errors) < self.max_attempts:
                    queue.retry(group, trial)
                    continue
                row = work.failed_row(trial, f"lost its worker {len(errors)} times (max_attempts={self.max_attempts}); "
                                             f"last: {errors[-1]}")
                info = {"worker": None, "trial_seconds": None, "model_load_s": None}
                attempts = len(errors)
            else:
                slot.name = info["worker"]
                attempts = len(lost.get(trial.key, ())) + 1
            queue.finished(group, trial)
            emit(trial, row, {**info, "attempts": attempts, "attempt_errors": list(lost.get(trial.key, ()))})
