"""The compile gate: every Triton configuration kvzoo ships compiles for sm_90 (H100/H200) on this CPU-only
machine, within the shared-memory limit and without register spills (kvzoo/kernels/compile_gate.py).

A kernel module ships its configurations through ``shipped_configs()``; this test finds every module
that has one. Registers per configuration are printed (``pytest -s``) and asserted only through spills.
"""

from __future__ import annotations

import importlib
import os
import pkgutil

import pytest

import kvzoo.kernels

triton = pytest.importorskip("triton", reason="SKIPPED LOUDLY: the compile gate needs triton (pip install 'triton==3.7.1')")

from kvzoo.kernels.compile_gate import SM90_SHARED_LIMIT, compile_sm90  # noqa: E402


def _shipped():
    configs = []
    for info in pkgutil.iter_modules(kvzoo.kernels.__path__):
        module = importlib.import_module(f"kvzoo.kernels.{info.name}")
        if hasattr(module, "shipped_configs"):
            configs += module.shipped_configs()
    return configs


CONFIGS = _shipped()


def test_the_expected_triton_compiles():
    """``make test-triton36`` sets KVZOO_EXPECT_TRITON=3.6: the gate must then really run on Triton 3.6."""
    expected = os.environ.get("KVZOO_EXPECT_TRITON")
    if expected:
        assert triton.__version__.startswith(expected), f"expected Triton {expected}, imported {triton.__version__}"


def test_some_configuration_ships():
    assert CONFIGS, "no kernel module lists shipped_configs()"


@pytest.mark.parametrize("config", CONFIGS, ids=[c.name for c in CONFIGS])
def test_compiles_for_sm90_within_shared_memory_and_without_spills(config):
    usage = compile_sm90(config)
    print(usage)
    assert usage.shared_bytes <= SM90_SHARED_LIMIT, str(usage)
    assert usage.local_bytes == 0 and usage.stack_bytes == 0, f"register spills: {usage}"
