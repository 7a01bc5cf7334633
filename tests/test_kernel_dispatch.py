"""KVZOO_KERNELS: which implementation a kernel call takes (kvzoo/kernels/dispatch.py)."""

from __future__ import annotations

import warnings

import pytest
import torch

from kvzoo.kernels import dispatch


def test_auto_takes_the_reference_on_cpu(monkeypatch):
    monkeypatch.delenv("KVZOO_KERNELS", raising=False)
    assert dispatch.mode() == "auto" and not dispatch.use_triton(torch.zeros(1))
    monkeypatch.setenv("KVZOO_KERNELS", "torch")
    assert not dispatch.use_triton(torch.zeros(1))


def test_a_bad_value_names_the_valid_ones(monkeypatch):
    monkeypatch.setenv("KVZOO_KERNELS", "cuda")
    with pytest.raises(ValueError, match=r"KVZOO_KERNELS='cuda' is not one of \('auto', 'torch', 'triton'\)"):
        dispatch.use_triton(torch.zeros(1))


def test_triton_on_cpu_without_the_interpreter_says_how(monkeypatch):
    monkeypatch.setenv("KVZOO_KERNELS", "triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if dispatch.triton_error() is not None:
        with pytest.raises(RuntimeError, match="triton is not importable.*pip install"):
            dispatch.use_triton(torch.zeros(1))
    else:
        with pytest.raises(RuntimeError, match="needs Triton's interpreter: set TRITON_INTERPRET=1"):
            dispatch.use_triton(torch.zeros(1))


def test_a_failing_kernel_falls_back_loudly_in_auto_and_raises_when_forced(monkeypatch):
    def broken(x):
        raise RuntimeError("no such kernel")

    monkeypatch.setattr(dispatch, "_failed", set())
    monkeypatch.delenv("KVZOO_KERNELS", raising=False)
    with pytest.warns(RuntimeWarning, match="the Triton kernel 'op' failed .*no such kernel.*PyTorch reference"):
        assert dispatch.run("op", broken, lambda x: x + 1, 1) == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once: the next call takes the reference quietly
        assert dispatch.run("op", broken, lambda x: x + 1, 1) == 2
    monkeypatch.setattr(dispatch, "_failed", set())
    monkeypatch.setenv("KVZOO_KERNELS", "triton")
    with pytest.raises(RuntimeError, match="no such kernel"):
        dispatch.run("op", broken, lambda x: x + 1, 1)
