"""One local Ray instance for the whole session: 2 CPUs, a small object store, no dashboard."""

from __future__ import annotations

import pytest

ray = pytest.importorskip(
    "ray", reason="SKIPPED LOUDLY: Ray is not installed, so the Ray executor is untested here: "
    "pip install 'kvzoo[ray]' (or `make test-ray`, which installs it)")


@pytest.fixture(scope="session")
def ray_cluster():
    """A local Ray instance the executors join (and leave running: they only stop what they started)."""
    if ray.is_initialized():
        ray.shutdown()
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=128 * 2**20, log_to_driver=False)
    yield ray
    ray.shutdown()
