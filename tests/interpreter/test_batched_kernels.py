"""The Triton path at batch > 1, in the interpreter: with a fixed capacity each layer passes its one live count
expanded to ``[B]`` (stride 0), which the kernels must read at ``b * stride``; with growing storage there is no
count at all. Every registered policy, GQA and MLA rows, batch 2 and 3: the logits of each decode step on the kernel
path against the PyTorch path on the same tokens, to float32 rounding."""

from __future__ import annotations

import functools

import pytest
import torch

from kvzoo import TieredCache, pipeline, registry
from kvzoo.models import tiny_deepseek_v2, tiny_llama

CONTEXT, STEPS = 160, 2


@functools.cache
def _model(family: str):
    return {"llama": tiny_llama, "deepseek_v2": tiny_deepseek_v2}[family]()[0]


def _policies() -> list[tuple[str, dict]]:
    out = [(name, {} if name == "full" else {"ratio": 4}) for name in registry.available()]
    out.append(("streaming_llm", {"ratio": 4, "retriever": "quest"}))  # Quest's page scan as a retriever
    return out


def _decode(model, policy_name: str, params: dict, ids: torch.Tensor, capacity: int | None,
            tokens: list[torch.Tensor] | None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    cache = TieredCache(model, registry.get(policy_name, **params), capacity=capacity)
    with torch.no_grad():
        logits = pipeline.prefill(model, cache, ids, ends_context=True)
        steps, fed = [], []
        for k in range(STEPS):
            token = logits.argmax(-1, keepdim=True) if tokens is None else tokens[k]
            fed.append(token)
            logits = model(input_ids=token, cache=cache, use_cache=True).logits[:, -1]
            steps.append(logits)
    return steps, fed


@pytest.mark.parametrize("family", ["llama", "deepseek_v2"])
@pytest.mark.parametrize("batch,capacity", [(2, 192), (3, 192), (2, None)])
@pytest.mark.parametrize("name,params", _policies(), ids=lambda v: v if isinstance(v, str) else
                         ",".join(f"{k}={x}" for k, x in v.items()) or "default")
def test_the_kernel_path_at_batch_above_one_matches_the_pytorch_path(family, batch, capacity, name, params,
                                                                     monkeypatch):
    model = _model(family)
    if model.config.model_type not in ("llama",) and "mla" not in registry.policy_class(name).layouts:
        pytest.skip(f"{name} has no MLA layout")
    if params.get("retriever") == "quest" and family != "llama":
        pytest.skip("the Quest retriever as configured here is checked on GQA rows")
    ids = torch.randint(3, model.config.vocab_size, (batch, CONTEXT), generator=torch.Generator().manual_seed(batch))
    monkeypatch.setenv("KVZOO_KERNELS", "torch")
    reference, fed = _decode(model, name, params, ids, capacity, None)
    monkeypatch.setenv("KVZOO_KERNELS", "triton")
    kernel, _ = _decode(model, name, params, ids, capacity, fed)
    for step, (want, got) in enumerate(zip(reference, kernel)):
        gap = (want - got).abs().max().item()
        assert gap < 1e-4, f"step {step}: the kernel path's logits differ by {gap:.3g} (sequence-wise: " \
                           f"{[(want[b] - got[b]).abs().max().item() for b in range(batch)]})"
