"""Reliability, fourth round (issue 44, items 4, 5 and 11): what a policy or model-family plugin hands the framework is
checked where it is received, and a plugin's fault names the plugin -- its class and, when an entry point provided
it, that distribution -- with its own exception chained."""

from __future__ import annotations

import dataclasses
import gc
import sys
import textwrap
import types
import weakref
from pathlib import Path
from typing import ClassVar

import pytest
import torch

from kvzoo import TieredCache, registry
from kvzoo.framework import cache as cache_module
from kvzoo.framework.attention import attach, detach
from kvzoo.framework.plugins import PluginError
from kvzoo.framework.policy import Policy, RowsView

pytestmark = pytest.mark.usefixtures("clean_registry")  # tests/conftest.py


@pytest.fixture(scope="module")
def llama():
    from kvzoo.models import tiny_llama

    return tiny_llama()[0]


def _ids(n, seed=0, vocab=256):
    return torch.randint(3, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


def _prefill_and_decode(model, cache, prompt=20, steps=3):
    with torch.no_grad():
        logits = model(input_ids=_ids(prompt), cache=cache, use_cache=True).logits[:, -1]
        cache.compress()
        for _ in range(steps):
            logits = model(input_ids=logits.argmax(-1, keepdim=True), cache=cache, use_cache=True).logits[:, -1]


@dataclasses.dataclass
class Rule(Policy):
    """A plugin policy whose ``priority`` / ``select`` / ``step_victim`` / ``target_rows`` do what ``make`` says
    (None: the base class's)."""

    on: str = "priority"
    make: object = None
    name: ClassVar[str] = "rule"
    schedule: ClassVar[str] = "step"

    def priority(self, rows: RowsView, keep: int) -> torch.Tensor:
        if self.on == "priority":
            return self.make(rows)
        return -rows.slots.float()  # keep the latest

    def select(self, rows: RowsView, keep: int) -> torch.Tensor:
        return self.make(rows) if self.on == "select" else super().select(rows, keep)

    def step_victim(self, rows: RowsView) -> torch.Tensor | None:
        return self.make(rows) if self.on == "step_victim" else super().step_victim(rows)

    def target_rows(self, event, **kwargs):
        return self.make(kwargs) if self.on == "target_rows" else super().target_rows(event, **kwargs)


def _boom(_):
    raise ZeroDivisionError("the plugin's own fault")


# --- item 4: scores on another device -------------------------------------------------------------------------------


@dataclasses.dataclass
class AtContextEnd(Rule):
    schedule: ClassVar[str] = "context_end"


@pytest.mark.parametrize("cls", [AtContextEnd, Rule], ids=["context_end", "step"])
def test_priority_on_another_device_is_refused_naming_the_policy(llama, cls):
    """At the context's end a ``meta`` tensor used to run (and the decode read garbage rows)."""
    cache = TieredCache(llama, cls(budget=8, make=lambda rows: torch.zeros(rows.slots.shape, device="meta")))
    with pytest.raises(ValueError, match=r"policy 'rule' \(.*\.\w*\).*priority\(\).*on device meta.*the rows are on cpu"):
        _prefill_and_decode(llama, cache)
    detach(llama)


def test_indices_on_another_device_are_refused_naming_the_policy(llama):
    policy = Rule(budget=8, on="select",
                  make=lambda rows: torch.arange(8, device="meta").expand(*rows.slots.shape[:2], 8))
    with pytest.raises(PluginError, match=r"policy 'rule' \(.*Rule\).*select\(\).*on device meta"):
        _prefill_and_decode(llama, TieredCache(llama, policy))
    detach(llama)


# --- item 5: an adapter cannot switch the wrong-model guard off ---------------------------------------------------


def test_an_adapter_naming_modules_that_are_not_the_models_is_refused(llama, monkeypatch):
    real = cache_module.adapter_for

    def strangers(model, policy):  # every layer mapped to a module of no model, collected at once
        adapter = real(model, policy)
        tiered = adapter.attention_modules()
        adapter.attention_modules = lambda: {i: torch.nn.Linear(1, 1) for i in tiered}
        return adapter

    monkeypatch.setattr(cache_module, "adapter_for", strangers)
    with pytest.raises(ValueError, match=r"model-family adapter 'gqa' \(.*\): attention_modules\(\) returned modules "
                                          r"that are not LlamaForCausalLM's.*layers \[0, 1"):
        TieredCache(llama, "full")
    detach(llama)


def test_a_cache_whose_bound_module_is_gone_refuses_every_forward():
    """The weak reference to the owner's attention module died: no module is the owner any more (the guard refuses;
    it used to accept any model's)."""
    from kvzoo.models import tiny_llama

    model, other = tiny_llama()[0], tiny_llama()[0]
    cache = TieredCache(model, "full")
    attach(other)  # kvzoo's attention on the other model too (it had a TieredCache of its own)
    with torch.no_grad():
        model(input_ids=_ids(6), cache=cache, use_cache=True)
    ghost = torch.nn.Linear(1, 1)
    for layer in cache.tiered_layers:
        layer.owner = weakref.ref(ghost)
    del ghost
    gc.collect()
    with torch.no_grad(), pytest.raises(RuntimeError, match=r"layer 0 of this TieredCache.*the attention module it was "
                                                              r"bound to is gone"):
        other(input_ids=_ids(1), cache=cache, use_cache=True)
    detach(model)
    detach(other)


# --- item 11: a policy's fault is named -------------------------------------------------------------------------


@pytest.mark.parametrize("archive", [False, True])
@pytest.mark.parametrize("past", [0, 999], ids=["just past", "999"])
def test_a_step_victim_past_the_tier_is_refused_naming_the_policy(llama, archive, past):
    """The row just past the tier (inside the storage's spare capacity) used to be taken silently: the next row
    went into a slot no one reads and no row left."""
    policy = Rule(budget=8, archive=archive, on="step_victim",
                  make=lambda rows: torch.full(rows.slots.shape[:2], rows.num_rows + past))
    cache = TieredCache(llama, policy)
    with pytest.raises(RuntimeError, match=r"policy 'rule' \(.*Rule\).*step_victim\(\).*outside the tier"):
        _prefill_and_decode(llama, cache, prompt=8, steps=4)
    detach(llama)


def test_a_select_returning_none_is_refused_naming_the_policy(llama):
    cache = TieredCache(llama, Rule(budget=8, on="select", make=lambda rows: None))
    with pytest.raises(PluginError, match=r"policy 'rule' \(.*Rule\): select\(\) must return int64 indices.*got None"):
        _prefill_and_decode(llama, cache)
    detach(llama)


@pytest.mark.parametrize("method", ["priority", "select", "step_victim", "target_rows"])
def test_a_raising_policy_method_is_named_with_its_exception_chained(llama, method):
    cache = TieredCache(llama, Rule(budget=8, on=method, make=_boom))
    with pytest.raises(PluginError, match=rf"policy 'rule' \(.*Rule\): {method}\(\) raised ZeroDivisionError: the "
                                          "plugin's own fault") as caught:
        _prefill_and_decode(llama, cache, prompt=8 if method == "step_victim" else 20)
    assert isinstance(caught.value.__cause__, ZeroDivisionError)
    detach(llama)


def test_a_raising_adapter_is_named_with_its_exception_chained(llama, monkeypatch):
    real = cache_module.adapter_for

    def broken(model, policy):
        adapter = real(model, policy)
        adapter.attach = lambda: _boom(None)
        return adapter

    monkeypatch.setattr(cache_module, "adapter_for", broken)
    with pytest.raises(PluginError, match=r"model-family adapter 'gqa' \(.*\): attach\(\) raised ZeroDivisionError") \
            as caught:
        TieredCache(llama, "full")
    assert isinstance(caught.value.__cause__, ZeroDivisionError)
    detach(llama)


@dataclasses.dataclass
class Sometimes(Policy):
    name: ClassVar[str] = "sometimes"
    schedule: ClassVar[str] = "sometimes"

    def priority(self, rows: RowsView, keep: int) -> torch.Tensor:
        return rows.slots.float()


def test_an_unknown_schedule_is_refused_at_registration_and_by_a_cache(llama):
    plugin = types.ModuleType("sometimes_plugin")
    plugin.kvzoo_policies = registry.hookimpl(lambda: [Sometimes])
    with pytest.raises(registry.RegistryError, match=r"plugin 'sometimes_plugin': policy 'sometimes' .*schedule="
                                                     "'sometimes'; use one of context_end, step, block"):
        registry.register_plugin(plugin)
    assert "sometimes" not in registry.available()  # not kept: the registry stays as it was
    with pytest.raises(ValueError, match=r"policy 'sometimes' \(.*Sometimes\): schedule='sometimes' is not a "
                                         "schedule; valid: context_end, step, block"):
        TieredCache(llama, Sometimes(budget=8))
    detach(llama)


FAULTY_PLUGIN = textwrap.dedent('''
    import dataclasses
    from typing import ClassVar

    import kvzoo.registry
    from kvzoo.framework.policy import Policy


    @dataclasses.dataclass
    class Faulty(Policy):
        name: ClassVar[str] = "faulty"

        def priority(self, rows, keep):
            raise KeyError("no such statistic")


    @kvzoo.registry.hookimpl
    def kvzoo_policies():
        return [Faulty]
''')


def test_an_entry_point_policy_fault_names_its_distribution(llama, tmp_path: Path, monkeypatch, request):
    module = "kvzoo_faulty_plugin"
    (tmp_path / f"{module}.py").write_text(FAULTY_PLUGIN)
    dist_info = tmp_path / "kvzoo_faulty-0.3.1.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: kvzoo-faulty\nVersion: 0.3.1\n")
    (dist_info / "entry_points.txt").write_text(f"[kvzoo]\nfaulty = {module}\n")
    request.addfinalizer(lambda: sys.modules.pop(module, None))
    monkeypatch.syspath_prepend(str(tmp_path))
    registry.reload()
    cache = TieredCache(llama, registry.get("faulty", budget=8))
    with pytest.raises(PluginError, match=r"policy 'faulty' \(kvzoo_faulty_plugin.Faulty, entry point 'faulty' of "
                                          r"kvzoo-faulty 0.3.1\): priority\(\) raised KeyError"):
        _prefill_and_decode(llama, cache)
    detach(llama)
