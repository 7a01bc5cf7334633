"""The committed locks (``locks/``): what ``make`` and CI install is pinned with hashes, agrees with
``pyproject.toml``'s ranges, and no make target installs from the index's ranges except ``make test-latest``.

These read the committed files only (no network, no installed versions)."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest
import tomllib
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("kvzoo_locks", ROOT / "locks" / "lock.py")
locks = sys.modules[_spec.name] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(locks)

PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
# the interpreter the CPU locks are resolved for (CI's): markers are evaluated for it, not for the one running this
LOCK_MARKERS = {**default_environment(), "python_version": locks.HERE_PYTHON, "python_full_version": "3.11.7",
                "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64"}


def _requirements(extras: tuple[str, ...]) -> list[Requirement]:
    reqs = [Requirement(r) for r in PROJECT["dependencies"]]
    reqs += [Requirement(r) for e in extras for r in PROJECT["optional-dependencies"][e]]
    return [r for r in reqs if r.marker is None or r.marker.evaluate({**LOCK_MARKERS, "extra": ""})]


@pytest.mark.parametrize("name", list(locks.ENVS))
def test_every_entry_is_pinned_exactly_with_hashes(name: str):
    lock = locks.lock_path(name)
    entries = locks.entries(lock)
    assert entries, f"{lock} pins nothing"
    for package, text in entries.items():
        assert re.match(rf"{re.escape(package)}==\S+ \\", locks.normal(text.splitlines()[0])), text.splitlines()[0]
        assert "--hash=sha256:" in text, f"{package} in {lock.name} has no hash"
    assert "make lock" in lock.read_text().splitlines()[1], "a lock names the command that regenerates it"


@pytest.mark.parametrize("name", ["venv", "ray"])
def test_the_locks_satisfy_the_ranges_users_get_and_the_pins_make_adds(name: str):
    env = locks.ENVS[name]
    pinned = locks.pins(locks.lock_path(name))
    for req in _requirements(env.extras):
        if req.name == "torch":  # installed apart (TORCH_SPEC); its dependencies are in the lock
            assert "torch" not in pinned
            continue
        assert locks.normal(req.name) in pinned, f"{req.name} ({req}) is not in locks/{name}.txt"
        assert req.specifier.contains(Version(pinned[locks.normal(req.name)]), prereleases=True), (
            req, pinned[locks.normal(req.name)])
    for line in (ROOT / "locks" / "pins.in").read_text().splitlines():
        if line and not line.startswith("#"):
            req = Requirement(line)
            if req.name != "torch":
                assert req.specifier.contains(Version(pinned[locks.normal(req.name)])), (name, line)


def test_adding_ray_changes_no_package_the_suite_runs_on():
    """venv-ray installs locks/ray.txt into .venv: resolved under venv's pins, it agrees on every shared package."""
    venv, ray = locks.pins(locks.lock_path("venv")), locks.pins(locks.lock_path("ray"))
    assert {n: v for n, v in ray.items() if n in venv} == venv
    assert "ray" in ray


def test_the_kvpress_lock_holds_kvpress_with_the_transformers_it_accepts():
    pinned = locks.pins(locks.lock_path("kvpress"))
    assert pinned["kvpress"] == "0.5.5" and Version(pinned["transformers"]) < Version("5.3")
    for req in _requirements(()):
        if locks.normal(req.name) not in ("torch", "transformers"):  # kvzoo goes in --no-deps: its others must be there
            assert locks.normal(req.name) in pinned, req


def test_the_gpu_bundle_lock_is_cp312s_and_keeps_huggingface_hub_on_1x():
    pinned = locks.pins(locks.lock_path("gpu-bundle"))
    assert locks.ENVS["gpu-bundle"].python == "3.12"
    assert pinned["huggingface-hub"].startswith("1.")  # 2.x needs httpx2, which the GPU image lacks
    assert pinned["transformers"] == locks.pins(locks.lock_path("venv"))["transformers"], (
        "the GPU bundle runs the transformers the CPU suite is locked to")


def _recipe_lines(makefile: str, target: str) -> list[str]:
    lines = makefile.splitlines()
    start = next(i for i, line in enumerate(lines) if re.match(rf"^{re.escape(target)}\s*:", line))
    body = []
    for line in lines[start + 1:]:
        if not line.startswith("\t"):
            break
        body.append(line)
    return body


def test_no_make_target_but_test_latest_and_lock_installs_from_the_index_unpinned():
    """Every pip install in the Makefile is a lock (--require-hashes), kvzoo itself (--no-deps), or TORCH_SPEC;
    only test-latest (the ranges, on purpose) and lock (the pinned uv) are exempt."""
    makefile = (ROOT / "Makefile").read_text()
    variables = dict(re.findall(r"^(\w+)\s*:?=\s*(.*)$", makefile, re.MULTILINE))
    exempt = {*_recipe_lines(makefile, "test-latest"), *_recipe_lines(makefile, "lock")}
    for line in makefile.splitlines():
        if not line.startswith("\t") or line in exempt:
            continue
        expanded = re.sub(r"\$\((\w+)\)", lambda m: variables.get(m.group(1), m.group(0)), line)
        if "pip install" not in expanded and "pip download" not in expanded:
            continue
        locked = "--require-hashes -r" in expanded and "--no-deps" in expanded
        kvzoo = expanded.rstrip().endswith("-e .") and "--no-deps" in expanded
        torch = '"$(TORCH_SPEC)"' in expanded
        assert locked or kvzoo or torch, f"an unlocked install in the Makefile: {line.strip()}"


def test_pick_gives_pip_a_hash_checked_requirement_and_names_what_a_lock_lacks():
    text = locks.pick(locks.lock_path("triton36"), ["triton"])
    assert text.startswith("triton==3.6.0 \\\n") and "--hash=sha256:" in text and "#" not in text
    with pytest.raises(SystemExit, match="pins no \\['not-a-package'\\]; it pins: triton"):
        locks.pick(locks.lock_path("triton36"), ["not-a-package"])
