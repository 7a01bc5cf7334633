"""The Triton kernels against their PyTorch references in Triton's CPU interpreter.

Run as its own process: ``TRITON_INTERPRET=1 python -m pytest tests/interpreter`` (``make test`` does).
Sizes are toys with every ``tl.dot`` dimension >= 16 (the real compiler's minimum); bf16 is not
tested here (the interpreter computes it wrong, docs/environment.md), fp32 and fp16 are.
"""

from __future__ import annotations

import os

import pytest

if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
    raise pytest.UsageError("tests/interpreter needs TRITON_INTERPRET=1 set before triton is imported "
                            "(run: TRITON_INTERPRET=1 python -m pytest tests/interpreter)")

try:
    import triton  # noqa: F401
except ImportError as err:  # pragma: no cover - CI installs it with the test extra
    pytest.skip(f"SKIPPED LOUDLY: triton is not importable ({err}); pip install 'triton==3.7.1'",
                allow_module_level=True)

from tests.interpreter import TOLERANCE  # noqa: E402,F401  (re-exported for older imports)


@pytest.fixture(autouse=True)
def _kernels_triton(monkeypatch):
    """Every test here runs the Triton path unless it sets KVZOO_KERNELS itself."""
    monkeypatch.setenv("KVZOO_KERNELS", "triton")
