"""The example policy of docs/extending.md, run as written: one file that registers itself as a plugin, then used
by name through the pipeline."""

from __future__ import annotations

import pathlib
import re
import sys
import types

import torch

from kvzoo import pipeline, registry

PAGE = pathlib.Path(__file__).resolve().parent.parent / "docs" / "extending.md"


def _example_source() -> str:
    text = PAGE.read_text()
    section = text[text.index("## Writing a policy"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_example_policy_registers_and_runs(tiny, monkeypatch, capsys):
    source = _example_source()
    policy_part = source[: source.index("registry.register_plugin")]
    assert len(policy_part.strip().splitlines()) <= 30  # a new policy is short
    module = types.ModuleType("extending_example")
    monkeypatch.setitem(sys.modules, "extending_example", module)  # as an imported module would be
    exec(compile(source, "docs/extending.md", "exec"), module.__dict__)  # registers the module as a plugin
    try:
        assert "SmallKeyNorm(ratio=8," in capsys.readouterr().out  # the block's own use of it
        policy = registry.get("small_key_norm", ratio=4)
        ids = torch.randint(1, 256, (400,), generator=torch.Generator().manual_seed(0))
        result = pipeline.generate(tiny, None, ids, ids[:5], policy, max_new_tokens=4)
        for layer in result.stats.layers:
            assert layer.resident_rows == 100 + 5 + 3  # the context at 1/4, then the question and decoded rows
        kept = result.cache.tiered_layers[0].slots[0, 0]
        assert kept[:4].tolist() == [0, 1, 2, 3]  # the sinks
        assert "small_key_norm" in registry.available()
    finally:
        registry.unregister_plugin("small_key_norm_plugin")
