"""kvzoo's main environment does not need kvpress: without it, ``kvpress:`` names and ``to_press`` say how to install it."""

from __future__ import annotations

import importlib.util

import pytest

from kvzoo import registry
from kvzoo.integrations.kvpress import KVPRESS_INSTALL, compression_ratio_for, ratio_for, to_press

pytestmark = pytest.mark.skipif(importlib.util.find_spec("kvpress") is not None,
                                reason="kvpress is installed here (tests/kvpress covers it)")


def test_kvpress_names_fail_with_the_install_command():
    with pytest.raises(KeyError) as err:
        registry.get("kvpress:KnormPress", compression_ratio=0.5)
    assert "kvpress is not installed" in str(err.value) and "make test-kvpress" in str(err.value)
    assert "pip install" in KVPRESS_INSTALL and "kvpress==0.5.5" in KVPRESS_INSTALL


def test_to_press_fails_with_the_install_command():
    with pytest.raises(ImportError, match="make test-kvpress"):
        to_press(registry.get("snapkv", ratio=4))


def test_the_ratio_mapping_needs_no_kvpress():
    assert compression_ratio_for(4) == 0.75 and ratio_for(0.75) == 4
    with pytest.raises(ValueError, match=">= 1"):
        compression_ratio_for(0.5)
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        ratio_for(1.0)
