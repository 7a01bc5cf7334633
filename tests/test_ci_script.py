"""``.ci/run`` prints its per-target time table on every exit, a failing target's included (issue 48 item 7)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("make") is None or shutil.which("bash") is None, reason="needs make and bash")
def test_the_time_table_is_printed_when_a_target_fails(tmp_path: Path):
    (tmp_path / ".ci").mkdir()
    shutil.copy(ROOT / ".ci" / "run", tmp_path / ".ci" / "run")
    # a stand-in Makefile: the environments build, `make test` fails; nothing after it runs
    (tmp_path / "Makefile").write_text("venv venv-triton36 venv-ray venv-kvpress:\n\t@true\ntest:\n\t@exit 3\n"
                                       "test-no-compiler:\n\t@echo should not run\n")
    done = subprocess.run(["bash", str(tmp_path / ".ci" / "run")], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2  # make's own exit status for a failed recipe
    lines = done.stdout.splitlines()
    table = lines[lines.index("CI time per target (environments apart):") + 1:]
    assert [line.split()[0] for line in table[:6]] == ["venv", "venv-triton36", "venv-ray", "venv-kvpress", "test",
                                                       "total"]
    assert "FAILED (exit 2)" in table[4]
    assert table[-1] == "CI failed (exit 2) in make test"
    assert "should not run" not in done.stdout


def test_every_pytest_run_of_the_makefile_prints_its_slowest_tests():
    recipes = (ROOT / "Makefile").read_text().replace("\\\n", " ").splitlines()
    runs = [line for line in recipes if "-m pytest" in line and not line.lstrip().startswith("#")]
    assert len(runs) >= 8
    assert [line for line in runs if "$(DURATIONS)" not in line] == []
