"""OpenMP's wait policy for kvzoo's commands and benchmarks.

PyTorch's CPU build runs its parallel ops on OpenMP threads that, by default, spin while they wait for work. A decode
step is hundreds of small ops; with 2 threads beside another CPU-heavy process, spinning threads fight that process
for the cores and a step costs 4-12x more (measured: docs/FACTS of the fourth round; ``benchmarks/decode_step.py``).
``OMP_WAIT_POLICY=PASSIVE`` lets them sleep instead. OpenMP reads the variable when it is loaded, i.e. when torch is
first imported: :func:`prefer_passive` must run before that, and says whether it could.

Importing this module imports nothing heavy (no torch).
"""

from __future__ import annotations

import os
import sys

VARIABLE = "OMP_WAIT_POLICY"


def prefer_passive() -> str:
    """Set ``OMP_WAIT_POLICY=PASSIVE`` unless the environment sets it; a one-line note of what is in effect."""
    if VARIABLE in os.environ:
        return f"{VARIABLE}={os.environ[VARIABLE]} (from the environment)"
    if "torch" in sys.modules:  # OpenMP is loaded already: setting it now would change nothing
        return f"{VARIABLE} unset (torch was imported before kvzoo could set it: OpenMP's default, spinning)"
    os.environ[VARIABLE] = "PASSIVE"
    return f"{VARIABLE}=PASSIVE (set by kvzoo: OpenMP's idle threads sleep; export {VARIABLE} to override)"
