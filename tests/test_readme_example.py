"""The README's example policy, run as written: one file registered as a plugin, then used by name."""

from __future__ import annotations

import pathlib
import re
import sys
import types

import torch

from kvzoo import pipeline, registry

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def _example_source() -> str:
    text = README.read_text()
    section = text[text.index("### Writing a policy"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_readme_example_policy_registers_and_runs(tiny, monkeypatch):
    source = _example_source()
    assert len(source.strip().splitlines()) <= 30  # a new policy is short
    module = types.ModuleType("readme_example")
    monkeypatch.setitem(sys.modules, "readme_example", module)  # as an imported module would be
    exec(compile(source, "README.md", "exec"), module.__dict__)
    registry.register_plugin(module, name="readme_example")
    try:
        policy = registry.get("small_key_norm", ratio=4)
        ids = torch.randint(1, 256, (400,), generator=torch.Generator().manual_seed(0))
        result = pipeline.generate(tiny, None, ids, ids[:5], policy, max_new_tokens=4)
        for layer in result.stats.layers:
            assert layer.resident_rows == 100 + 5 + 3  # the context at 1/4, then the question and decoded rows
        kept = result.cache.tiered_layers[0].slots[0, 0]
        assert kept[:4].tolist() == [0, 1, 2, 3]  # the sinks
        assert "small_key_norm" in registry.available()
    finally:
        registry.unregister_plugin("readme_example")
