"""The host work of a decode step: how many kvzoo Python functions one layer-step enters (issue 46's bounds).

On a GPU a small batch's step is its host time; on CPU it is what keeps a short context's compressed step slower
than ``full``'s. Measured with :class:`kvzoo.bench.step_trace.HostCalls` over one steady step of tiny Llama with
budget 64 (a 300-token prompt: every policy has evicted and, with a retriever, archived rows). A count is exact
(no timing): a change that adds calls to the step fails here and says where they went.
"""

from __future__ import annotations

import pytest
import torch

from kvzoo import TieredCache, registry
from kvzoo.bench.step_trace import count_host_calls
from kvzoo.framework.attention import detach
from kvzoo.kernels import cpu_native
from kvzoo.models import tiny_llama

# entries per layer-step (before issue 46: quest 323, vestige 216, snapkv 59)
BOUNDS = {"snapkv": 50, "quest": 120, "vestige": 100}
PARAMS = {"snapkv": {"budget": 64}, "quest": {"budget": 64, "dense_layers": 0}, "vestige": {"budget": 64}}


@pytest.fixture(scope="module")
def model():
    return tiny_llama()[0]


@pytest.mark.skipif(cpu_native.toolchain_missing() is not None,
                    reason=f"{cpu_native.toolchain_missing()}: the bounds are for the native CPU path")
@pytest.mark.parametrize("name", list(BOUNDS))
def test_a_layer_step_enters_few_kvzoo_functions(model, name):
    prompt = torch.randint(3, model.config.vocab_size, (1, 300), generator=torch.Generator().manual_seed(0))
    detach(model)
    cache = TieredCache(model, registry.get(name, **PARAMS[name]))
    try:
        calls = count_host_calls(model, cache, prompt)
    finally:
        detach(model)
    layers = len(cache.tiered_layers)
    per_layer = calls.total / layers
    top = ", ".join(f"{f} {n / layers:.0f}" for f, n in calls.by_function.most_common(8))
    assert per_layer <= BOUNDS[name], f"{name}: {per_layer:.0f} kvzoo function entries per layer-step (most: {top})"
