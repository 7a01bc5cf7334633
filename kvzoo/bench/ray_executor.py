"""``RayExecutor``: a leaderboard's trials on a Ray cluster (``kvzoo leaderboard --executor ray``).

One actor per worker slot holds a :class:`~kvzoo.bench.runner.TrialRunner` (a model loaded once per worker) and
runs one trial at a time, handed out by a :class:`~kvzoo.bench.executors.TrialQueue` as workers free up. A worker
the cluster cannot hold is refused before any starts, one not placed within ``placement_timeout`` is given up
naming what it waits for, and one that dies under a trial is replaced, the trial retried up to ``max_attempts``
(rows carry ``attempts`` and ``attempt_errors``). Ray is imported only when a ``RayExecutor`` is made.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

from kvzoo.bench.executors import (
    Emit,
    ExecutorUnavailable,
    TrialGroup,
    TrialQueue,
    Work,
    int_option,
    number_option,
    timed_run,
)

RAY_INSTALL = "pip install 'kvzoo[ray]'"  # what --executor ray needs (the extra pins a Ray that kvzoo is tested with)

LOCAL_OBJECT_STORE_BYTES = 256 * 2**20  # a local instance's object store: rows are small, models never travel
PLACEMENT_TIMEOUT_S = 120.0  # how long a worker may wait for the cluster to reserve its CPUs and GPUs


class RayUnavailable(ExecutorUnavailable):
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
    placement: Any = None  # the worker's placement group (one bundle: its CPUs and GPUs)
    ready: bool = False  # the placement group is ready: the cluster reserved the worker's resources
    deadline: float = 0.0  # time.monotonic() by which it must be ready


def _cause(err: BaseException) -> str:
    """A worker fault in one line: the exception, its first line, and Ray's exit detail when it gives one."""
    text = str(err).strip()
    first = text.splitlines()[0] if text else ""
    detail = ""
    if "Worker exit detail:" in text:
        detail = text.split("Worker exit detail:", 1)[1].strip().split(". ")[0]
    cause = f"{type(err).__name__}: {first}" + (f" ({detail})" if detail else "")
    return cause if len(cause) <= 400 else cause[:397] + "..."


class _WorkerPool:
    """The workers' side of a run (:class:`RayExecutor` schedules trials onto them): what one worker asks for, how many
    fit, and each worker's actor started in a placement group of its own (the timeout measures placement alone)."""

    def __init__(self, ray: Any, work: Work, *, cpus: float, gpus: float, placement_timeout: float) -> None:
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.ray, self.work, self.placement_timeout = ray, work, placement_timeout
        self.needs = {"CPU": cpus, **({"GPU": gpus} if gpus else {})}  # what one worker asks the cluster for
        self._placement_group, self._strategy = placement_group, PlacementGroupSchedulingStrategy
        self._actor_class = ray.remote(num_cpus=cpus, num_gpus=gpus, max_restarts=0, max_task_retries=0)(TrialWorker)
        self._threads, self._device = max(1, int(cpus)), ("cuda" if gpus else None)
        self.placing: dict[Any, _Slot] = {}  # the placement groups not ready yet: their workers are not placed

    def worker_count(self, workers: int | None) -> int:
        """How many workers to start: ``workers``, or as many as the cluster holds; a :class:`RayUnavailable`
        naming the resource when the cluster cannot hold one (Ray would wait for it forever)."""
        resources = self.ray.cluster_resources()
        fits = []
        for name, need in self.needs.items():
            have = resources.get(name, 0)
            if have < need:
                hint = (" (no GPU is visible to Ray here: leave out --gpus-per-worker to run on CPUs)"
                        if name == "GPU" and not have else "")
                raise RayUnavailable(
                    f"the cluster has {have:g} {name}{'s' if have != 1 else ''} in all: not enough for one worker at "
                    f"{name.lower()}s_per_worker={need:g}{hint}. Nothing was started")
            fits.append(int(have // need))
        return workers if workers is not None else max(1, min(fits))

    def start(self, slot: _Slot) -> None:
        """A new actor in ``slot``, in a placement group of one bundle: ready once the cluster reserved its CPUs
        and GPUs."""
        slot.placement = self._placement_group([self.needs])
        slot.actor = self._actor_class.options(
            scheduling_strategy=self._strategy(placement_group=slot.placement)
        ).remote(self.work.make_runner, self._threads, self._device)
        slot.name = f"ray worker {slot.index}" + (f" (restart {slot.restarts})" if slot.restarts else "")
        slot.busy, slot.group_key, slot.model = False, None, None
        slot.ready, slot.deadline = False, time.monotonic() + self.placement_timeout
        self.placing[slot.placement.ready()] = slot

    def release(self, slot: _Slot) -> None:
        """Stop ``slot``'s actor and free its placement group."""
        from ray.util.placement_group import remove_placement_group

        for stop in (lambda: self.ray.kill(slot.actor, no_restart=True), lambda: remove_placement_group(slot.placement)):
            try:
                stop()
            except Exception:  # already dead or removed, or the cluster went away: nothing left to stop
                pass

    def unplaceable(self, late: list[_Slot], left: int) -> str:
        """Why the workers ``late`` were given up, naming what they wait for (``left``: workers still running)."""
        available, total = self.ray.available_resources(), self.ray.cluster_resources()
        short = [f"{need:g} {name} (free now: {available.get(name, 0):g} of {total.get(name, 0):g})"
                 for name, need in self.needs.items() if available.get(name, 0) < need]
        waits = (f"each needs {' and '.join(short)}" if short else
                 f"the cluster has {', '.join(f'{need:g} {name}' for name, need in self.needs.items())} free in "
                 "all, but no single node holds one worker's")
        names = ", ".join(slot.name for slot in late)
        ahead = f"; going on with the {left} worker(s) that started" if left else ""
        return (f"{names} could not be placed on the Ray cluster within {self.placement_timeout:g} s: {waits}{ahead}. "
                "Free those resources, ask for less (--cpus-per-worker, --gpus-per-worker, --workers), or wait longer "
                "(--placement-timeout)")


class RayExecutor:
    """Trials on Ray: ``workers`` actors (None: as many as the cluster allows), each ``cpus_per_worker`` CPUs and
    ``gpus_per_worker`` GPUs (a worker with a GPU runs on ``cuda``).

    ``address``: None starts a local Ray instance (or uses this process's), ``"auto"`` joins this machine's cluster,
    ``"ray://host:10001"`` a remote one; every node needs kvzoo and the model files. ``max_attempts``: workers a trial
    may lose before it is an error; ``placement_timeout``: seconds a worker may wait to be placed.
    """

    name = "ray"
    summary = f"on a Ray cluster, one worker per slot holding a loaded model (needs `{RAY_INSTALL}`)"

    @classmethod
    def add_arguments(cls, group: argparse._ArgumentGroup) -> None:
        """``kvzoo leaderboard``'s Ray options (each ``dest`` a constructor keyword)."""
        group.add_argument("--address", help="ray: the cluster -- auto (this machine's `ray start --head`) or "
                           "ray://HOST:10001; default: start a local Ray instance")
        group.add_argument("--workers", type=int_option("--workers"),
                           help="ray: worker slots (default: as many as the cluster's CPUs or GPUs allow)")
        group.add_argument("--gpus-per-worker", type=number_option("gpus-per-worker"),
                           help="ray: GPUs per worker, fractions allowed (a worker with a GPU runs its model on cuda)")
        group.add_argument("--cpus-per-worker", type=number_option("cpus-per-worker", strict=True),
                           help="ray: CPUs per worker, also its torch threads (default 1)")
        group.add_argument("--max-attempts", type=int_option("--max-attempts"),
                           help="ray: workers a trial may lose (killed, out of memory) before it is recorded as an "
                           "error (default 3)")
        group.add_argument("--placement-timeout", type=number_option("placement-timeout", strict=True), metavar="S",
                           help="ray: seconds a worker may wait to be placed on the cluster (its CPUs/GPUs free) "
                           "before the run stops naming the resource (default 120)")

    def __init__(
        self,
        address: str | None = None,
        workers: int | None = None,
        gpus_per_worker: float = 0.0,
        cpus_per_worker: float = 1.0,
        max_attempts: int = 3,
        object_store_memory: int | None = None,
        placement_timeout: float = PLACEMENT_TIMEOUT_S,
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
        if isinstance(placement_timeout, bool) or not isinstance(placement_timeout, (int, float)) or \
                not 0 < placement_timeout < float("inf"):
            raise ValueError(f"placement_timeout must be a number of seconds > 0, got {placement_timeout!r}")
        self.placement_timeout = float(placement_timeout)
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
        # What ray.init raises when it cannot start or reach Ray is not one class: a local instance whose processes
        # do not come up in time (a loaded machine) is a bare Exception ("The current node timed out during
        # startup", ray/_private/node.py, Ray 2.x), or TimeoutError from ray._private.services.wait_for_node in
        # older releases; a cluster that cannot be reached, ConnectionError or RuntimeError. Any of them means the
        # same here: no Ray to run on, said in one message (RayUnavailable), not a traceback.
        if self.address is None:
            cpus = os.cpu_count() or 1
            if self.workers is not None:
                cpus = max(cpus, math.ceil(self.workers * self.cpus_per_worker))
            try:
                ray.init(address="local", num_cpus=cpus, include_dashboard=False, log_to_driver=False,
                         object_store_memory=self.object_store_memory or LOCAL_OBJECT_STORE_BYTES)
            except Exception as err:
                self._shutdown_quietly()
                raise RayUnavailable(
                    f"could not start a local Ray instance ({_cause(err)}). A machine under heavy load can take "
                    "longer to start Ray's processes than ray.init waits: rerun when it is less busy (the results "
                    "file resumes where it stopped), or start Ray yourself (`ray start --head`) and pass --address "
                    "auto; without Ray, leave out --executor ray"
                ) from err
            return True
        try:
            ray.init(address=self.address, log_to_driver=False)
        except Exception as err:
            self._shutdown_quietly()
            raise RayUnavailable(
                f"could not connect to the Ray cluster at {self.address!r} ({_cause(err)}). Start one "
                "with `ray start --head` on the head node (then --address auto there, or ray://HEAD:10001 from "
                "elsewhere), or leave out --address to start a local Ray instance"
            ) from err
        return True

    def _shutdown_quietly(self) -> None:
        """Stop what a failed ``ray.init`` may have started (nothing to stop is fine)."""
        try:
            self.ray.shutdown()
        except Exception:  # noqa: BLE001 - Ray half started or not at all: nothing more to undo
            pass

    # --- running -------------------------------------------------------------------------------------
    def run(self, work: Work, emit: Emit) -> None:
        if not work.groups:
            return
        started_here = self._connect()
        slots: list[_Slot] = []
        pool = None
        try:
            pool = _WorkerPool(self.ray, work, cpus=self.cpus_per_worker, gpus=self.gpus_per_worker,
                               placement_timeout=self.placement_timeout)
            slots = [_Slot(i) for i in range(min(pool.worker_count(self.workers), work.trial_count))]
            for slot in slots:
                pool.start(slot)
            self._loop(work, emit, slots, pool)
        finally:
            for slot in slots:
                pool.release(slot)
            if started_here:
                self.ray.shutdown()

    def _loop(self, work: Work, emit: Emit, slots: list[_Slot], pool: _WorkerPool) -> None:
        ray, placing = self.ray, pool.placing
        queue = TrialQueue(work.groups)
        in_flight: dict[Any, tuple[_Slot, TrialGroup, Any]] = {}
        lost: dict[str, list[str]] = {}  # trial key -> one cause per worker it lost

        def hand_out() -> None:
            for slot in slots:
                if slot.busy or not slot.ready:
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
            if not in_flight and not placing:  # a group waits for a reference that nobody runs: a bug in TrialQueue
                raise RuntimeError(f"{len(queue)} trials are left but none can start")
            timeout = None
            if placing:  # wake up when the first worker still being placed runs out of time
                timeout = max(0.0, min(slot.deadline for slot in placing.values()) - time.monotonic())
            done, _ = ray.wait([*in_flight, *placing], num_returns=1, timeout=timeout)
            if not done:
                now = time.monotonic()
                late = [slot for slot in placing.values() if slot.deadline <= now]
                if not late:  # woke a little early
                    continue
                for ref in [ref for ref, slot in placing.items() if slot in late]:
                    del placing[ref]
                for slot in late:
                    pool.release(slot)
                    slots.remove(slot)
                message = pool.unplaceable(late, len(slots))
                if not slots:
                    raise RayUnavailable(message)
                print(f"kvzoo: {message}", file=sys.stderr)
                continue
            (ref,) = done
            if ref in placing:  # placed (a worker that then fails to start shows on its first trial, as a loss)
                placing.pop(ref).ready = True
                continue
            slot, group, trial = in_flight.pop(ref)
            slot.busy = False
            try:
                row, info = ray.get(ref)
            except ray.exceptions.RayError as err:  # the worker died (killed, out of memory, node lost)
                errors = lost.setdefault(trial.key, [])
                errors.append(f"{slot.name}: {_cause(err)}")
                pool.release(slot)
                slot.restarts += 1
                pool.start(slot)  # a new process in this slot; the trial goes to whichever worker is free first
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
