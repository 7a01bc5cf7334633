"""kvzoo's commands let OpenMP's idle threads sleep unless the user chose otherwise (kvzoo/openmp.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

PROBE = "import kvzoo.cli, os, torch; print(os.environ.get('OMP_WAIT_POLICY')); print(kvzoo.cli.OPENMP_NOTE)"


def _probe(**env: str) -> list[str]:
    clean = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    out = subprocess.run([sys.executable, "-c", PROBE], env={**clean, **env}, capture_output=True, text=True,
                         check=True, timeout=120)
    return out.stdout.strip().splitlines()


def test_cli_sets_passive_before_torch_loads():
    value, note = _probe()
    assert value == "PASSIVE" and "set by kvzoo" in note


@pytest.mark.parametrize("chosen", ["ACTIVE"])
def test_cli_keeps_the_users_choice(chosen):
    value, note = _probe(OMP_WAIT_POLICY=chosen)
    assert value == chosen and "from the environment" in note


def test_too_late_says_so(monkeypatch):
    from kvzoo.openmp import prefer_passive

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert "torch was imported before" in prefer_passive()  # torch is loaded in this process
    assert "OMP_WAIT_POLICY" not in os.environ
