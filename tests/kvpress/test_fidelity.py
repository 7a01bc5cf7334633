"""Fidelity badges: with kvpress's parameters, kvzoo's ports keep exactly kvpress's rows, layer by layer and head by head.

kvzoo's runtime (``TieredCache``, the context compressed at its end) against kvpress's presses in kvpress's
hook, on SmolLM2-135M (real weights, 2,000 tokens of text) and a tiny random Llama (GQA, 400 random ids).
With kvzoo's paper defaults the rows differ, in the ways each policy's docstring lists.
"""

from __future__ import annotations

import kvpress
import pytest
import torch

from kvzoo import registry

RATIO = 4  # kvzoo: keep 1/4; kvpress: compression_ratio 0.75

# kvzoo's port with kvpress's parameters, and kvpress's press
PAIRS = {
    "streaming_llm": (
        lambda: registry.get("streaming_llm", ratio=RATIO, sinks=4),
        lambda: kvpress.StreamingLLMPress(compression_ratio=0.75, n_sink=4),
    ),
    "snapkv": (
        lambda: registry.get("snapkv", ratio=RATIO, window=64, kernel_size=5, pooling="avgpool", aggregate="mean"),
        lambda: kvpress.SnapKVPress(compression_ratio=0.75, window_size=64, kernel_size=5),
    ),
    "chunkkv": (
        lambda: registry.get("chunkkv", ratio=RATIO, window=64, kernel_size=5, pooling="avgpool", aggregate="mean",
                             chunk_size=20, reuse=1, tiling="kvpress"),
        lambda: kvpress.ChunkKVPress(press=kvpress.SnapKVPress(compression_ratio=0.75, window_size=64, kernel_size=5),
                                     chunk_length=20),
    ),
}


def _same_rows(zoo: list[torch.Tensor], press: list[torch.Tensor]) -> list[str]:
    """Where the two disagree: 'layer l head g: n rows differ', empty when every layer and head matches."""
    out = []
    for layer, (a, b) in enumerate(zip(zoo, press)):
        assert a.shape == b.shape, f"layer {layer}: kvzoo keeps {tuple(a.shape)}, kvpress {tuple(b.shape)}"
        for g in range(a.shape[1]):
            differ = len(set(a[0, g].tolist()) ^ set(b[0, g].tolist())) // 2
            if differ:
                out.append(f"layer {layer} head {g}: {differ} rows differ")
    return out


@pytest.mark.parametrize("port", list(PAIRS))
def test_port_keeps_kvpress_rows_on_smollm2(port, smol, smol_ids, kv):
    model, _ = smol
    policy, press = PAIRS[port]
    zoo, ref = kv.zoo_rows(model, smol_ids, policy()), kv.press_rows(model, smol_ids, press())
    assert len(zoo) == 30 and zoo[0].shape == (1, 3, 500)  # 2,000 rows / 4, every layer and KV head
    assert _same_rows(zoo, ref) == []


@pytest.mark.parametrize("port", list(PAIRS))
def test_port_keeps_kvpress_rows_on_a_tiny_llama(port, tiny, tiny_ids, kv):
    policy, press = PAIRS[port]
    zoo, ref = kv.zoo_rows(tiny, tiny_ids, policy()), kv.press_rows(tiny, tiny_ids, press())
    assert zoo[0].shape == (1, 2, 100)
    assert _same_rows(zoo, ref) == []


@pytest.mark.parametrize("port", ["snapkv", "chunkkv"])
def test_paper_defaults_differ_from_kvpress_as_the_docstrings_say(port, tiny, tiny_ids, kv):
    """kvzoo's defaults (the papers') keep other rows than kvpress's defaults; each differing parameter is named in
    the port's docstring together with kvpress's value."""
    _, press = PAIRS[port]
    zoo, ref = kv.zoo_rows(tiny, tiny_ids, registry.get(port, ratio=RATIO)), kv.press_rows(tiny, tiny_ids, press())
    assert _same_rows(zoo, ref) != []
    doc = type(registry.get(port, ratio=RATIO)).__doc__
    said = {"snapkv": ("kernel_size=5", "avgpool", "64-query window", "kvpress"),
            "chunkkv": ("chunk_length=20", "index reuse", "kvpress", "kernel_size")}[port]
    assert all(phrase in doc for phrase in said), said
