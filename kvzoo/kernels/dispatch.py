"""Which implementation a kernel call takes: Triton for CUDA tensors, the PyTorch reference otherwise.

Every op in ``kvzoo/kernels/`` has a PyTorch reference and a Triton kernel with the same signature; :func:`use_triton`
decides per call from the tensors' device and ``KVZOO_KERNELS``: unset or ``auto`` (CUDA tensors take Triton when it
imports), ``torch`` (the reference everywhere) or ``triton`` (Triton everywhere; CPU tensors then need
``TRITON_INTERPRET=1``, how CI tests the kernels without a GPU). The variable is read at each call, so a test may
switch it between steps; Triton is imported only when a Triton path is taken.
"""

from __future__ import annotations

import functools
import importlib
import os
import warnings
from collections import Counter

import torch

ENV = "KVZOO_KERNELS"
MODES = ("auto", "torch", "triton")
INSTALL = "pip install 'triton==3.7.1'  (the version torch 2.13's CUDA wheel pins)"


def mode() -> str:
    """``KVZOO_KERNELS`` (``auto`` when unset); a ValueError names the valid values."""
    value = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if value not in MODES:
        raise ValueError(f"{ENV}={os.environ[ENV]!r} is not one of {MODES}: 'auto' (Triton on CUDA tensors), "
                         "'torch' (the PyTorch references) or 'triton' (the kernels, on CPU under TRITON_INTERPRET=1)")
    return value


@functools.cache
def triton_error() -> str | None:
    """Why Triton cannot be used here (None when it can)."""
    try:
        importlib.import_module("triton")
        importlib.import_module("triton.language")
    except Exception as err:  # ImportError, or a broken install raising something else
        return f"triton is not importable ({type(err).__name__}: {err}); install it with {INSTALL}"
    return None


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def check_startup(on_cpu: bool) -> str:
    """:func:`mode`, checked before a command loads anything: a ValueError when ``KVZOO_KERNELS`` is not a mode, or is
    ``triton`` where the kernels cannot run -- Triton not importable, or ``on_cpu`` (the command's tensors stay on
    the CPU) without Triton's interpreter. What :func:`use_triton` would raise at the first kernel call, said first."""
    chosen = mode()
    if chosen == "triton" and on_cpu:
        if not interpreting():
            raise ValueError(f"{ENV}=triton runs the Triton kernels, and this command's tensors are on the CPU, where "
                             "Triton runs only in its interpreter: set TRITON_INTERPRET=1 too (a test mode, slow), "
                             f"or use {ENV}=torch (or leave it unset: auto)")
        problem = triton_error()
        if problem is not None:
            raise ValueError(f"{ENV}=triton but {problem}")
    return chosen


def use_triton(tensor: torch.Tensor) -> bool:
    """Whether a kernel call on ``tensor``'s device takes the Triton kernel (see the module docstring)."""
    chosen = mode()
    if chosen == "torch":
        return False
    if chosen == "auto":
        return tensor.is_cuda and triton_error() is None
    problem = triton_error()
    if problem is not None:
        raise RuntimeError(f"{ENV}=triton but {problem}")
    if not tensor.is_cuda and not interpreting():
        raise RuntimeError(
            f"{ENV}=triton on {tensor.device.type} tensors needs Triton's interpreter: set TRITON_INTERPRET=1 "
            f"before triton is imported (or use {ENV}=torch)"
        )
    return True


_failed: set[str] = set()
# what each op's calls took: (op, "triton") or (op, "fallback: <error>"), counted; read by benchmarks that must say
# which path they timed (make gpu-check)
calls: Counter = Counter()
STRICT_ENV = "KVZOO_KERNELS_STRICT"  # =1: a kernel that fails raises even in auto mode (what a benchmark needs)


def run(name: str, triton_fn, reference_fn, *args, **kwargs):
    """``triton_fn(*args, **kwargs)``; in ``auto`` mode a kernel that fails to compile or launch is reported
    once (a RuntimeWarning naming the op and the error) and the reference runs instead from then on.
    With ``KVZOO_KERNELS=triton`` or ``KVZOO_KERNELS_STRICT=1`` the error propagates. :data:`calls` counts what ran."""
    if name in _failed:
        calls[(name, "fallback")] += 1
        return reference_fn(*args, **kwargs)
    try:
        out = triton_fn(*args, **kwargs)
        calls[(name, "triton")] += 1
        return out
    except Exception as err:
        if mode() == "triton" or os.environ.get(STRICT_ENV, "0") not in ("", "0"):  # no silent fallback
            raise
        _failed.add(name)
        warnings.warn(f"kvzoo: the Triton kernel {name!r} failed ({type(err).__name__}: {err}); using the PyTorch "
                      f"reference for it from now on (set {ENV}=triton to make this an error)", RuntimeWarning,
                      stacklevel=2)
        return reference_fn(*args, **kwargs)
