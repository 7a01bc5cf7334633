"""glibc's mmap threshold, set once unless the environment chose, and the prefill's peak RSS over the loaded model
(kvzoo/allocator.py)."""

from __future__ import annotations

import ctypes
import os
import platform
import subprocess
import sys

import pytest

from kvzoo import allocator

VARIABLES = (allocator.VARIABLE, allocator.OFF)
glibc_only = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")


@pytest.fixture
def fresh(monkeypatch):
    """The module as in a process that has not set anything yet, mallopt recorded instead of called."""
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(allocator, "_note", None)
    calls: list[tuple[int, int]] = []
    monkeypatch.setattr(allocator, "_mallopt", lambda: lambda param, value: calls.append((param, value)) or 1)
    return calls


def test_sets_the_threshold_once_and_says_so(fresh):
    note = allocator.prefer_mmap_threshold()
    assert fresh == [(allocator.M_MMAP_THRESHOLD, 4 << 20)]
    assert "set by kvzoo" in note and "4194304" in note
    assert os.environ[allocator.VARIABLE] == "4194304"  # the processes it starts get it from their start
    assert allocator.mmap_threshold() == 4 << 20
    assert allocator.prefer_mmap_threshold() == note and len(fresh) == 1  # a second call does nothing again


def test_the_environments_threshold_is_left_alone(fresh, monkeypatch):
    monkeypatch.setenv(allocator.VARIABLE, "65536")
    note = allocator.prefer_mmap_threshold()
    assert fresh == [] and "from the environment" in note and os.environ[allocator.VARIABLE] == "65536"
    assert allocator.mmap_threshold() == 65536


def test_kvzoo_off_keeps_glibcs_dynamic_threshold(fresh, monkeypatch):
    monkeypatch.setenv(allocator.OFF, "0")
    note = allocator.prefer_mmap_threshold()
    assert fresh == [] and "dynamic" in note and allocator.VARIABLE not in os.environ
    assert allocator.mmap_threshold() is None


def test_without_glibc_nothing_is_set_and_the_note_says_so(fresh, monkeypatch):
    monkeypatch.setattr(allocator, "_mallopt", lambda: None)
    assert "not glibc" in allocator.prefer_mmap_threshold()
    assert allocator.VARIABLE not in os.environ


def _clean_env(**extra: str) -> dict[str, str]:
    return {**{k: v for k, v in os.environ.items() if k not in VARIABLES}, **extra}


def test_the_cli_sets_it_at_import():
    out = subprocess.run([sys.executable, "-c", "import kvzoo.cli, os; print(os.environ.get('MALLOC_MMAP_THRESHOLD_'));"
                          " print(kvzoo.cli.MALLOC_NOTE)"], env=_clean_env(), capture_output=True, text=True,
                         check=True, timeout=120)
    value, note = out.stdout.strip().splitlines()
    expected = ("4194304", "set by kvzoo") if platform.libc_ver()[0] == "glibc" else ("None", "not glibc")
    assert value == expected[0] and expected[1] in note


# glibc's own behaviour, in a fresh process: free an 8 MiB block, then ask for 8 MiB again, and count the bytes
# malloc holds in mappings of their own (mallinfo2's hblkhd) while the second block lives. glibc's dynamic threshold
# rose to 8 MiB at the free, so the second block comes from the heap (and stays resident after a free); at a fixed
# 4 MiB it is mapped again (and unmapped at its free).
PROBE = """
import ctypes, sys
from kvzoo.allocator import prefer_mmap_threshold
print(prefer_mmap_threshold(), file=sys.stderr)
class Info(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.mallinfo2.restype = Info
before = libc.mallinfo2().hblkhd
libc.free(libc.malloc(8 << 20))
block = libc.malloc(8 << 20)
print(libc.mallinfo2().hblkhd - before)
libc.free(block)
"""


@glibc_only
@pytest.mark.parametrize(("env", "mapped"), [({}, True), ({allocator.OFF: "0"}, False)])
def test_the_threshold_takes_effect_in_glibc(env, mapped):
    if not hasattr(ctypes.CDLL("libc.so.6"), "mallinfo2"):
        pytest.skip("mallinfo2: glibc >= 2.33")
    root = os.path.dirname(os.path.dirname(os.path.abspath(allocator.__file__)))
    out = subprocess.run([sys.executable, "-c", PROBE], env=_clean_env(**env, PYTHONPATH=root), capture_output=True,
                         text=True, check=True, timeout=60)
    assert (int(out.stdout.strip()) >= 8 << 20) == mapped, out.stderr


STATUS = """Name:\tpython
VmPeak:\t 5000000 kB
VmHWM:\t 1843200 kB
VmRSS:\t 1024000 kB
"""


def test_peak_over_the_loaded_model_is_the_peak_less_the_models_rss(monkeypatch):
    monkeypatch.setattr(allocator, "_peak_reset", True)
    fields = allocator.peak_over_model(1000.0, STATUS)  # the RSS at the mark: 1000 MiB
    assert fields == {"peak_rss_mib": 1800.0, "model_rss_mib": 1000.0, "peak_rss_over_model_mib": 800.0,
                      "peak_since_mark": True}


def test_mark_model_resets_the_peak_to_the_rss_of_the_moment():
    if not os.path.exists("/proc/self/clear_refs"):
        pytest.skip("Linux's /proc/self/clear_refs")
    block = bytearray(64 << 20)  # 64 MiB resident, then freed: the peak stays above the RSS until the mark
    del block
    rss = allocator.mark_model()
    fields = allocator.peak_over_model(rss)
    if not fields["peak_since_mark"]:
        pytest.skip("clear_refs not writable here")
    assert 0 <= fields["peak_rss_over_model_mib"] < 32
