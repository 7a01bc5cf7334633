"""Hypothesis profiles of the reliability suite: ``ci`` (bounded, the default) and ``long`` (``make soak``).

Select with ``KVZOO_HYPOTHESIS_PROFILE=long``.
"""

from __future__ import annotations

import functools
import os

import pytest
from hypothesis import HealthCheck, settings

from kvzoo.models import TINY_FAMILIES

settings.register_profile("ci", max_examples=8, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
settings.register_profile("long", max_examples=150, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
settings.load_profile(os.environ.get("KVZOO_HYPOTHESIS_PROFILE", "ci"))


@functools.cache
def model(name: str):
    return TINY_FAMILIES[name]()[0]


MODELS = tuple(TINY_FAMILIES)


@pytest.fixture(scope="session")
def models():
    return model
