"""Reliability, third round (issue 34), the leaderboard harness's side: an executor plugin's rows are matched to the
trials it was given before anything is written; register_plugin keeps no plugin that fails its checks; a full disk
leaves no partial line; an ok row of another configuration is never a trial's result; a context no model can hold
is refused before any task is built; Ray's start-up timeout is one clear message. Each test failed on the code
before its fix. (The CLI's bad-input cases of this round are rows of test_bad_inputs.py.)"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path
from typing import ClassVar

import pytest

from kvzoo import TieredCache, registry
from kvzoo.bench.executors import Work
from kvzoo.cli import main
from kvzoo.framework.adapters.gqa import GQAAdapter
from kvzoo.models import tiny_llama


@pytest.fixture(autouse=True)
def clean_registry():
    registry.reset()
    yield
    registry.reset()


def _cli(args: list[str]) -> int:
    """Run the CLI; argparse's refusals become the exit code they would have been."""
    try:
        return main(args)
    except SystemExit as stop:
        return stop.code


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


# --- test executors: rows of the trials given, without running them -----------------------------------------

# `kvzoo leaderboard --preset tiny` narrowed to three trials: full, streaming_llm 2x and 4x, question after
THREE_TRIALS = ["leaderboard", "--preset", "tiny", "--policies", "full,streaming_llm", "--ratios", "2", "4",
                "--positions", "after", "--no-plots", "--no-progress"]
INFO = {"worker": "test", "trial_seconds": 0.0, "model_load_s": 0.0, "attempts": 1, "attempt_errors": []}


def _trials(work: Work) -> list:
    return [trial for group in work.groups for trial in group.trials]


def _row(work: Work, trial) -> dict:
    """A valid row of ``trial`` without running it (the row of a trial no worker could finish)."""
    return work.failed_row(trial, "not run: a test executor")


class _TestExecutor:
    summary = "a test executor"

    @classmethod
    def add_arguments(cls, group) -> None:
        """No options."""


def _register_executor(cls: type) -> None:
    @registry.hookimpl
    def kvzoo_executors():
        return [cls]

    registry.register_plugin(types.SimpleNamespace(kvzoo_executors=kvzoo_executors), name=f"test-{cls.name}")


# --- register_plugin keeps no plugin that fails its checks ----------------------------------------------------


class ClaimsLlama(GQAAdapter):
    name: ClassVar[str] = "claims_llama"
    model_types: ClassVar[tuple[str, ...]] = ("llama",)  # a built-in adapter serves it


class TypesAsStr(GQAAdapter):
    name: ClassVar[str] = "types_as_str"
    model_types: ClassVar[str] = "toy_llama"  # a str, not a tuple of them


class NotAnAdapter:
    name = "not_an_adapter"


class LocalAgain(_TestExecutor):
    name = "local"  # the built-in executor's name

    def run(self, work, emit):
        raise AssertionError("never registered")


def _adapters(*classes):
    @registry.hookimpl
    def kvzoo_adapters():
        return list(classes)

    return types.SimpleNamespace(kvzoo_adapters=kvzoo_adapters)


def _executors(*classes):
    @registry.hookimpl
    def kvzoo_executors():
        return list(classes)

    return types.SimpleNamespace(kvzoo_executors=kvzoo_executors)


@pytest.mark.parametrize(("plugin", "message"), [
    (lambda: _adapters(ClaimsLlama), r"kvzoo_adapters: 'llama' is claimed twice: by built-in plugin 'kvzoo\.builtins' "
                                     r".* and by plugin 'bad', class .*ClaimsLlama"),
    (lambda: _adapters(TypesAsStr), r"plugin 'bad': adapter .*TypesAsStr needs model_types: "
                                    r"ClassVar\[tuple\[str, \.\.\.\]\].*\(got 'toy_llama'\)"),
    (lambda: _adapters(NotAnAdapter), r"plugin 'bad': adapter .*NotAnAdapter needs model_types"),
    (lambda: _executors(LocalAgain), r"kvzoo_executors: 'local' is claimed twice: by built-in plugin "
                                     r"'kvzoo\.builtins' .* and by plugin 'bad', class .*LocalAgain"),
], ids=["adapter claiming llama", "model_types a str", "no adapter", "executor named local"])
def test_a_plugin_that_fails_registration_is_not_kept(plugin, message):
    """Before: each was kept (register_plugin checked only the policy tables), and the next TieredCache on any model
    failed until it was unregistered. Now register_plugin refuses it naming what was wrong, and the registry is as
    it was: the built-in Llama still gets a cache, the executors are the built-in ones."""
    with pytest.raises(registry.RegistryError, match=message):
        registry.register_plugin(plugin(), name="bad")
    with pytest.raises(KeyError, match="'bad' is not a registered plugin"):
        registry.unregister_plugin("bad")
    TieredCache(tiny_llama()[0], "full").close()
    assert list(registry.executors()) == ["local", "ray"]
    assert registry.adapters()["llama"].__name__ == "GQAAdapter"


# --- Ray's start-up timeout is one clear message --------------------------------------------------------------


class _FakeRay(types.SimpleNamespace):
    """What kvzoo's Ray executor calls before a worker starts, with ``ray.init`` raising ``error``."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(shutdowns=0)
        self.error = error

    def is_initialized(self) -> bool:
        return False

    def init(self, **kwargs) -> None:
        raise self.error

    def shutdown(self) -> None:
        self.shutdowns += 1


# ray/_private/node.py (Ray 2.60): a local node whose raylet is not up in 30 s is a bare Exception; older releases
# raised ray._private.services.wait_for_node's TimeoutError
STARTUP_TIMEOUT = Exception("The current node timed out during startup. This could happen because some of the raylet "
                            "failed to startup or the GCS has become overloaded.")


@pytest.mark.parametrize(("error", "address", "message"), [
    (STARTUP_TIMEOUT, [], r"could not start a local Ray instance \(Exception: The current node timed out during "
                          r"startup\..*\)\. A machine under heavy load"),
    (TimeoutError("Timed out after 60 seconds while waiting for node to startup."), [],
     r"could not start a local Ray instance \(TimeoutError: Timed out after 60 seconds"),
    (STARTUP_TIMEOUT, ["--address", "auto"], r"could not connect to the Ray cluster at 'auto' \(Exception: The current "
                                             r"node timed out during startup"),
], ids=["local, Ray 2.x", "local, older Ray", "--address auto"])
def test_rays_start_up_timeout_is_a_clear_message_not_a_traceback(tmp_path, monkeypatch, capsys, error, address,
                                                                  message):
    """Seen once under heavy load: ray.init's start-up timeout escaped `kvzoo leaderboard --executor ray` as a
    traceback. Faked here (ray.init raising what Ray raises): exit 2, the message says what happened and what to
    do, the half-started Ray is shut down, nothing is written."""
    fake = _FakeRay(error)
    monkeypatch.setitem(sys.modules, "ray", fake)
    out = tmp_path / "r.jsonl"
    assert _cli([*THREE_TRIALS, "--executor", "ray", "--workers", "1", *address, "--out", str(out)]) == 2
    assert pytest.importorskip("re").search(message, capsys.readouterr().err)
    assert fake.shutdowns == 1 and not out.exists()
