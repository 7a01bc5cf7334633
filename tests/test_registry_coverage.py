"""Tests that claim every registered policy iterate the registry: a policy a plugin adds is traced op for op
(``tests/test_static_step.py``) and held to its one-in-one-out rule (``tests/test_runtime.py``) with no line of
those tests touched. Proved here by installing a plugin through the ``kvzoo`` entry-point group and running them."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

PLUGIN = '''
from dataclasses import dataclass
from typing import ClassVar

import torch

import kvzoo.registry
from kvzoo.framework.policy import Policy, RowsView


@dataclass
class Newest(Policy):
    """Keep the newest rows, one in and one out at every decode step (a toy sliding window)."""

    name: ClassVar[str] = "newest_rows"
    summary: ClassVar[str] = "the newest rows (test plugin)"
    layouts: ClassVar[tuple[str, ...]] = ("gqa",)
    schedule: ClassVar[str] = "step"

    def priority(self, rows: RowsView, keep: int) -> torch.Tensor:
        return rows.slots.to(torch.float32)


@kvzoo.registry.hookimpl
def kvzoo_policies():
    return [Newest]
'''


def test_a_plugin_policy_is_picked_up_by_the_tests_that_iterate_the_registry(tmp_path: Path):
    (tmp_path / "newest_rows_plugin.py").write_text(textwrap.dedent(PLUGIN))
    dist_info = tmp_path / "newest_rows-0.1.0.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: newest-rows\nVersion: 0.1.0\n")
    (dist_info / "entry_points.txt").write_text("[kvzoo]\nnewest_rows = newest_rows_plugin\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", "-k", "newest_rows",
         "tests/test_static_step.py", "tests/test_runtime.py"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    # traced op for op (with the C ops and with the PyTorch references) and run with and without capacity on the GQA
    # families (its layout: Llama and Gemma 3), and its per-step victim held to its selection; the MLA families
    # skipped (a gqa-only policy)
    assert re.search(r"\b7 passed\b", run.stdout) and re.search(r"\b6 skipped\b", run.stdout), run.stdout[-3000:]
