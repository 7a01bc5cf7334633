"""kvzoo.registry: built-ins through the hook, plugins by register_plugin and by entry point, errors."""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
import shutil
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import pytest
import torch

import kvzoo.policies
from kvzoo import registry
from kvzoo.framework.policy import Policy, RowsView
from kvzoo.policies.full import Full
from kvzoo.policies.streaming_llm import StreamingLLM

TESTS_DIR = Path(__file__).parent
PLUGIN_FILE = TESTS_DIR / "plugin_example.py"
BASE_FIELDS = {f.name for f in dataclasses.fields(Policy)}
BUILTINS = [entry["name"] for entry in registry.read_manifest()]  # registry.toml order


pytestmark = pytest.mark.usefixtures("clean_registry")  # tests/conftest.py


@pytest.fixture
def plugin_example(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    monkeypatch.syspath_prepend(str(TESTS_DIR))
    return importlib.import_module("plugin_example")


def make_plugin(*classes: object) -> types.SimpleNamespace:
    """A plugin object whose kvzoo_policies() returns ``classes``."""

    @registry.hookimpl
    def kvzoo_policies():
        return list(classes)

    return types.SimpleNamespace(kvzoo_policies=kvzoo_policies)


@dataclass
class ImpostorKeepFirst(Policy):
    name: ClassVar[str] = "keep_first"

    def priority(self, rows: RowsView, keep: int) -> torch.Tensor:
        raise NotImplementedError


@dataclass
class ImpostorFull(Policy):
    name: ClassVar[str] = "full"

    def priority(self, rows: RowsView, keep: int) -> torch.Tensor:
        raise NotImplementedError


@dataclass
class Nameless(Policy):
    def priority(self, rows: RowsView, keep: int) -> torch.Tensor:
        raise NotImplementedError


@dataclass
class Unfinished(Policy):
    name: ClassVar[str] = "unfinished"


@dataclass
class MisObserving(ImpostorKeepFirst):
    name: ClassVar[str] = "misobserving"
    observes: ClassVar[frozenset[str]] = frozenset({"windows"})  # a typo of "window"


@dataclass
class ObservingText(ImpostorKeepFirst):
    name: ClassVar[str] = "observing_text"
    observes: ClassVar[str] = "window"  # a string, not a set of observations


# --- built-ins -----------------------------------------------------------------------------------


def test_builtins_come_first_in_manifest_order():
    names = list(registry.available())
    assert names[:2] == ["full", "streaming_llm"]  # the manifest order
    assert registry.available()["streaming_llm"] == StreamingLLM.summary
    assert registry.policy_class("full") is Full
    assert registry.policy_class("streaming_llm") is StreamingLLM


def test_get_builds_configured_dataclass_with_paper_defaults():
    policy = registry.get("streaming_llm", ratio=4)
    assert type(policy) is StreamingLLM
    assert (policy.ratio, policy.budget, policy.sinks, policy.schedule, policy.block_size) == (4, None, 4, "step", 256)
    assert policy.archive is False and policy.retriever is None  # eviction only: evicted rows are freed
    assert registry.get("streaming_llm", ratio=4, retriever="vestige").archive is True  # a retriever reads them
    assert registry.get("streaming_llm", ratio=4, archive=True).archive is True  # asked for


def test_get_applies_overrides_including_retriever():
    policy = registry.get(
        "streaming_llm", budget=64, sinks=8, schedule="block", block_size=32, archive=False, retriever="quest"
    )
    assert (policy.budget, policy.sinks, policy.schedule, policy.block_size) == (64, 8, "block", 32)
    assert policy.archive is False and policy.retriever == "quest"
    # a policy's config() is exactly what get() takes back
    assert registry.get(**policy.config()) == policy
    assert registry.get("full") == Full()


def test_info_reports_fields_and_source():
    about = registry.info("streaming_llm")
    assert about["name"] == "streaming_llm"
    assert about["paper"] == "https://arxiv.org/abs/2309.17453"
    assert about["layouts"] == ["gqa", "mla"]
    assert about["defaults"] == {
        "ratio": None, "budget": None, "archive": None, "retriever": None,  # None: an archive where a retriever reads one
        "sinks": 4, "schedule": "step", "block_size": 256, "prefill": "dense",
    }
    assert about["class"] == "kvzoo.policies.streaming_llm:StreamingLLM"
    assert about["plugin"] == registry.BUILTIN_PLUGIN_NAME
    assert registry.BUILTIN_PLUGIN_NAME in about["source"]


# --- errors that say what is valid ---------------------------------------------------------------


def test_unknown_name_lists_available_and_suggests_close_match():
    with pytest.raises(KeyError) as excinfo:
        registry.get("streaming-llm", ratio=4)
    message = str(excinfo.value)
    assert "unknown policy 'streaming-llm'" in message
    assert "did you mean 'streaming_llm'?" in message
    assert "Available policies: full, streaming_llm" in message
    with pytest.raises(KeyError, match="Available policies: full, streaming_llm"):
        registry.policy_class("zzz")
    with pytest.raises(KeyError, match="unknown policy 'zzz'"):
        registry.info("zzz")


def test_unknown_parameter_names_it_and_lists_valid_ones():
    with pytest.raises(TypeError) as excinfo:
        registry.get("streaming_llm", ratio=4, sink=2)
    message = str(excinfo.value)
    assert "streaming_llm: unknown parameter 'sink'; did you mean 'sinks'?" in message
    assert "ratio, budget, archive, retriever, schedule, block_size, sinks, prefill" in message
    with pytest.raises(TypeError, match="unknown parameters 'window', 'alpha'"):
        registry.get("full", window=3, alpha=1.0)


def test_invalid_value_keeps_type_and_names_policy():
    # StreamingLLM.validate's message does not name the policy: the registry prefixes it
    with pytest.raises(ValueError, match=r"^streaming_llm: sinks must be an int >= 0 \(attention sinks kept at the start\), got -1$"):
        registry.get("streaming_llm", ratio=4, sinks=-1)
    with pytest.raises(TypeError, match=r"^streaming_llm: ratio must be a number >= 1"):
        registry.get("streaming_llm", ratio="4")
    # messages that already name the policy pass through unchanged
    with pytest.raises(ValueError, match=r"^full keeps every row and takes no ratio/budget"):
        registry.get("full", ratio=2)
    with pytest.raises(ValueError, match=r"^streaming_llm needs a budget"):
        registry.get("streaming_llm")


# --- plugins -------------------------------------------------------------------------------------


def test_registered_plugin_is_listed_and_built(plugin_example: types.ModuleType):
    assert "keep_first" not in registry.available()
    assert registry.register_plugin(plugin_example) == "plugin_example"
    assert list(registry.available()) == [*BUILTINS, "keep_first"]
    assert registry.available()["keep_first"] == "keep the first rows (test plugin)"

    policy = registry.get("keep_first", ratio=2)
    assert type(policy) is plugin_example.KeepFirst and policy.ratio == 2
    valid = torch.ones(2, 3, 10, dtype=torch.bool)
    rows = RowsView(keys=torch.zeros(2, 3, 10, 4), values=None, slots=torch.zeros(2, 3, 10, dtype=torch.long),
                    valid=valid, layer_idx=0, num_layers=1)
    kept = policy.select(rows, keep=5)
    assert kept.shape == (2, 3, 5)
    assert torch.equal(kept[1, 2], torch.arange(5))

    about = registry.info("keep_first")
    assert about["plugin"] == "plugin_example"
    assert about["layouts"] == ["gqa"]
    assert "plugin 'plugin_example'" in about["source"] and "plugin_example:KeepFirst" in about["source"]


def test_registering_twice_is_a_noop_and_unregister_removes(plugin_example: types.ModuleType):
    registry.register_plugin(plugin_example)
    registry.register_plugin(plugin_example)
    assert list(registry.available()).count("keep_first") == 1
    registry.unregister_plugin("plugin_example")
    assert "keep_first" not in registry.available()
    with pytest.raises(KeyError, match="not a registered plugin"):
        registry.unregister_plugin("plugin_example")


def test_reset_forgets_registered_plugins(plugin_example: types.ModuleType):
    registry.register_plugin(plugin_example)
    registry.reset()
    assert list(registry.available()) == BUILTINS


def test_discovery_is_cached_until_reload():
    calls = []

    @registry.hookimpl
    def kvzoo_policies():
        calls.append(1)
        return []

    registry.register_plugin(types.SimpleNamespace(kvzoo_policies=kvzoo_policies), name="counting")
    registry.available()
    registry.get("full")
    registry.info("full")
    assert len(calls) == 1
    registry.reload()
    assert len(calls) == 2


def test_two_plugins_claiming_one_name_name_both(plugin_example: types.ModuleType):
    registry.register_plugin(plugin_example)
    with pytest.raises(registry.RegistryError) as excinfo:
        registry.register_plugin(make_plugin(ImpostorKeepFirst), name="impostor")
    message = str(excinfo.value)
    assert "policy name 'keep_first' is claimed twice" in message
    assert "plugin 'impostor'" in message and f"{__name__}:ImpostorKeepFirst" in message
    assert "plugin 'plugin_example'" in message and "plugin_example:KeepFirst" in message
    # the rejected plugin is not kept: the registry still works
    assert type(registry.get("keep_first", ratio=2)).__module__ == "plugin_example"


def test_plugin_cannot_take_a_builtin_name():
    with pytest.raises(registry.RegistryError) as excinfo:
        registry.register_plugin(make_plugin(ImpostorFull), name="shadow")
    message = str(excinfo.value)
    assert "policy name 'full' is claimed twice" in message
    assert registry.BUILTIN_PLUGIN_NAME in message and "kvzoo.policies.full:Full" in message
    assert "plugin 'shadow'" in message and f"{__name__}:ImpostorFull" in message
    assert registry.policy_class("full") is Full


@pytest.mark.parametrize(
    ("returned", "expected"),
    [
        ([dict], r"plugin 'bad'.*returned <class 'dict'>, which is not a Policy subclass"),
        ([Full()], r"plugin 'bad'.*returned Full\(.*\), which is not a Policy subclass"),
        ([Nameless], r"plugin 'bad'.*test_registry:Nameless has no name"),
        ([Policy], r"plugin 'bad'.*has no name"),
        ([Unfinished], r"plugin 'bad'.*policy 'unfinished' .*does not implement priority"),
        ([MisObserving], r"plugin 'bad'.*policy 'misobserving' observes 'windows', which the runtime does not record; "
                         r"valid observations: window, accumulate, inputs"),
        ([ObservingText], r"policy 'observing_text': observes must be a frozenset of observations"),
    ],
)
def test_malformed_plugin_is_rejected_by_name(returned: list, expected: str):
    with pytest.raises(registry.RegistryError, match=expected):
        registry.register_plugin(make_plugin(*returned), name="bad")
    assert list(registry.available()) == BUILTINS


def test_plugin_returning_a_non_list_is_rejected():
    @registry.hookimpl
    def kvzoo_policies():
        return "keep_first"

    with pytest.raises(registry.RegistryError, match="plugin 'text'.*must return a list of Policy subclasses"):
        registry.register_plugin(types.SimpleNamespace(kvzoo_policies=kvzoo_policies), name="text")


def test_misspelt_hook_is_rejected():
    @registry.hookimpl
    def kvzoo_policy():
        return [Full]

    with pytest.raises(registry.RegistryError, match="kvzoo_policy"):
        registry.register_plugin(types.SimpleNamespace(kvzoo_policy=kvzoo_policy), name="typo")


def test_entry_point_plugin_is_discovered(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          request: pytest.FixtureRequest):
    """A distribution on sys.path declaring ``[kvzoo] keep_first = <module>`` is loaded via importlib.metadata."""
    module = "kvzoo_keep_first_plugin"
    shutil.copy(PLUGIN_FILE, tmp_path / f"{module}.py")
    dist_info = tmp_path / "kvzoo_keep_first-0.1.0.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: kvzoo-keep-first\nVersion: 0.1.0\n")
    (dist_info / "entry_points.txt").write_text(f"[kvzoo]\nkeep_first = {module}\n")
    request.addfinalizer(lambda: sys.modules.pop(module, None))

    assert "keep_first" not in registry.available()
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "keep_first" not in registry.available()  # cached until reload
    registry.reload()

    assert list(registry.available()) == [*BUILTINS, "keep_first"]
    policy = registry.get("keep_first", budget=8)
    assert type(policy).__module__ == module and policy.budget == 8
    source = registry.info("keep_first")["source"]
    assert "plugin 'keep_first' (entry point of kvzoo-keep-first 0.1.0)" in source
    assert f"{module}:KeepFirst" in source


# --- registry.toml agrees with the code ----------------------------------------------------------


def test_manifest_lists_names_and_classes_only():
    """registry.toml holds name and module:Class; summary, paper, layouts and defaults come from the class."""
    manifest = registry.read_manifest()
    assert [entry["name"] for entry in manifest] == list(registry.available())[: len(manifest)]
    for entry in manifest:
        cls = registry.policy_class(entry["name"])
        assert set(entry) == {"name", "module"} and entry["module"] == f"{cls.__module__}:{cls.__qualname__}"
        about = registry.info(entry["name"])
        assert (about["summary"], about["paper"], about["layouts"]) == (cls.summary, cls.paper, list(cls.layouts))
    retrievers = registry.read_manifest(kind="retriever")
    assert [entry["name"] for entry in retrievers] == list(registry.retrievers()) == ["vestige", "quest"]
    for entry in retrievers:
        cls = registry.retriever_class(entry["name"])
        assert entry["module"] == f"{cls.__module__}:{cls.__qualname__}"


def test_every_policy_module_is_in_the_manifest():
    """A policy file under kvzoo/policies/ that registry.toml does not list would be unreachable by name."""
    listed = {entry["module"] for entry in registry.read_manifest()}
    defined = set()
    for module_info in pkgutil.iter_modules(kvzoo.policies.__path__, "kvzoo.policies."):
        if module_info.name.rpartition(".")[2].startswith("_"):
            continue
        module = importlib.import_module(module_info.name)
        for obj in vars(module).values():
            if (isinstance(obj, type) and issubclass(obj, Policy) and obj.__module__ == module.__name__
                    and obj.name):
                defined.add(f"{obj.__module__}:{obj.__qualname__}")
    assert defined - listed == set(), "add these policies to kvzoo/registry.toml"
