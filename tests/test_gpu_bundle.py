"""``benchmarks/gpu_bundle.py``: the preflight that refuses a transformers / huggingface-hub kvzoo does not support,
and the pins of the wheels ``make gpu-bundle`` carries to the GPU machine."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import gpu_bundle  # noqa: E402


def test_the_preflight_refuses_transformers_517_naming_the_version_and_the_fix():
    result = gpu_bundle.preflight({"transformers": "5.17.0"}, probe=False)
    assert not result["ok"]
    assert any("transformers 5.17.0" in p and ">=5.18" in p for p in result["problems"])
    assert "make gpu-bundle" in result["fix"] and "--no-index --no-deps --target" in result["fix"]


def test_the_preflight_refuses_a_huggingface_hub_older_than_transformers_needs():
    """The bundle's transformers' requirements come from the committed copy of its wheel's metadata, whatever
    transformers is installed where the test runs."""
    bundled = gpu_bundle.BUNDLE["transformers"]
    result = gpu_bundle.preflight({"transformers": bundled, "huggingface-hub": "1.30.0"}, probe=False)
    assert not result["ok"]
    assert any("huggingface-hub 1.30.0" in p and ">=1.31" in p and f"transformers {bundled} " in p
               for p in result["problems"])


def test_the_preflight_reads_the_bundles_requirements_from_the_lock_not_the_installed_transformers(monkeypatch):
    """A transformers release on the index (installed here with other requirements) changes nothing the preflight
    says of the bundle's versions; a pretended version nobody here knows is named as unchecked, not judged by
    another version's requirements."""
    monkeypatch.setattr(gpu_bundle.metadata, "requires", lambda name: ["huggingface-hub>=99", "tokenizers>=99"])
    result = gpu_bundle.preflight(dict(gpu_bundle.BUNDLE), probe=False)
    assert result["unchecked"] == [] and not any("huggingface-hub" in p or "tokenizers" in p
                                                  for p in result["problems"])
    unknown = gpu_bundle.preflight({"transformers": "5.30.0"}, probe=False)
    assert unknown["unchecked"] and "transformers 5.30.0" in unknown["unchecked"][0]


def test_the_preflight_passes_here_and_its_probe_sees_cache_filled():
    assert gpu_bundle.preflight(probe=False)["ok"]
    assert gpu_bundle.probe_cache_kwarg() is None


def test_the_probe_catches_a_forward_that_drops_cache(monkeypatch):
    """transformers 5.17's DeepseekV2 takes past_key_values= and swallows cache= into **kwargs (seen there, and here
    with a 5.17 wheel): the probe must say so, whatever the version number says."""
    from transformers import DeepseekV2ForCausalLM

    forward = DeepseekV2ForCausalLM.forward

    def dropping(self, *args, cache=None, **kwargs):
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(DeepseekV2ForCausalLM, "forward", dropping)
    problem = gpu_bundle.probe_cache_kwarg()
    assert problem is not None and "holding 0 tokens" in problem and "ignores cache=" in problem


def test_the_carried_pins_satisfy_kvzoo_and_what_transformers_requires():
    """The bundle's pins (locks/gpu-bundle.txt) against its own transformers' requirements (the committed copy of
    that wheel's metadata), never against whichever transformers the index served here today."""
    from packaging.requirements import Requirement

    pins = {gpu_bundle._normal(k): v for k, v in gpu_bundle.BUNDLE.items()}
    assert Requirement(gpu_bundle.kvzoo_requirement()).specifier.contains(pins["transformers"])
    version, requires = gpu_bundle.locks.bundle_requires()
    assert version == pins["transformers"], "locks/gpu-bundle.transformers-requires.txt is another version's: make lock"
    required = {gpu_bundle._normal(Requirement(r).name): Requirement(r) for r in requires}
    for name in ("huggingface-hub", "tokenizers", "safetensors", "regex"):
        assert required[name].specifier.contains(pins[name]), (name, pins[name], str(required[name].specifier))
    assert pins["huggingface-hub"].startswith("1.")  # 2.x needs httpx2, which the GPU image lacks


def test_the_preflight_also_holds_torch_and_triton_to_kvzoos_ranges():
    assert gpu_bundle.TRITON_REQUIREMENT in (gpu_bundle.ROOT / "pyproject.toml").read_text()
    assert gpu_bundle.kvzoo_requirement("torch").startswith("torch>=2.4")
    result = gpu_bundle.preflight({"triton": "3.5.0"}, probe=False)
    assert result["problems"] == ["triton 3.5.0 is installed; kvzoo (pyproject.toml) needs triton>=3.6"]
