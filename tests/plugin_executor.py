"""An executor added from outside kvzoo, as a package would ship it: one class (with its own CLI option), one hook.

``ReversedExecutor`` runs every trial in this process like the local one, each group's trials after its
reference in reverse plan order, and tags each row's ``worker`` with its ``--tag``. tests/test_executors.py
registers it with ``kvzoo.registry.register_plugin`` and runs ``kvzoo leaderboard --executor reversed``.
"""

from __future__ import annotations

import argparse

import kvzoo.registry
from kvzoo.bench.executors import Emit, Work, timed_run


class ReversedExecutor:
    name = "reversed"
    summary = "this process, each group's trials after its reference in reverse order (test plugin)"

    def __init__(self, tag: str = "reversed") -> None:
        self.tag = tag

    @classmethod
    def add_arguments(cls, group: argparse._ArgumentGroup) -> None:
        group.add_argument("--tag", help="reversed: what each row's worker field says")

    def run(self, work: Work, emit: Emit) -> None:
        runner = work.make_runner()
        for group in work.groups:
            head = group.trials[:1] if group.first_is_reference else []
            for trial in head + group.trials[len(head):][::-1]:
                row, info = timed_run(runner, trial, work.reference(trial))
                emit(trial, row, {**info, "worker": self.tag, "attempts": 1, "attempt_errors": []})


@kvzoo.registry.hookimpl
def kvzoo_executors() -> list[type]:
    return [ReversedExecutor]
