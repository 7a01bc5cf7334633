"""End to end in Triton's interpreter: every registered policy gives the same tokens on the kernel path.

The decode step takes ``kvzoo/kernels/decode_attention/`` (the tier and the fetched rows in one
split-K launch) and the retrievers' scans take ``kvzoo/kernels/index_scan.py`` when
``KVZOO_KERNELS=triton``; with ``torch`` everything runs the PyTorch path. Greedy tokens must agree
on tiny DeepSeek-V2 and tiny Kimi Linear (MLA, absorbed rows of 512 + 64) and on a tiny Llama (GQA).
"""

from __future__ import annotations

import functools

import pytest
import torch

from kvzoo import pipeline, registry
from kvzoo.kernels import decode_attention
from kvzoo.models import TINY_FAMILIES

BUILDERS = TINY_FAMILIES
CONTEXT, QUESTION, NEW = 160, 6, 4


@pytest.fixture(scope="module", params=list(BUILDERS))
def model(request):
    return BUILDERS[request.param]()[0]


def _ids(n, seed, vocab):
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def _counted(calls, original, *args, **kwargs):
    calls.append(1)
    return original(*args, **kwargs)


def _policies():
    cases = [(name, {} if name == "full" else {"ratio": 4}) for name in registry.available()]
    # the retrieval tiers at decode: VestigeKV's certified rule (the fused scan reduced over heads) and
    # StreamingLLM with Quest's page index as a retriever
    cases.append(("vestige", {"ratio": 4, "block_size": 64,
                              "retriever": registry.build_retriever("vestige", certified=True)}))
    cases.append(("streaming_llm", {"ratio": 4, "retriever": "quest"}))
    cases.append(("quest", {"ratio": 4, "gqa": "group"}))  # Quest's group rule: the scan reduced over heads
    return cases


@pytest.mark.parametrize("name,params", _policies(), ids=lambda v: v if isinstance(v, str) else
                         ",".join(f"{k}={getattr(x, 'name', x)}" for k, x in v.items())
                         or "default")
def test_same_tokens_on_the_kernel_path(model, name, params, monkeypatch):
    vocab = model.config.vocab_size
    context, question = _ids(CONTEXT, 1, vocab), _ids(QUESTION, 2, vocab)
    runs, launches, original = {}, {}, decode_attention.triton.launch
    for kernels in ("torch", "triton"):
        monkeypatch.setenv("KVZOO_KERNELS", kernels)
        calls = launches.setdefault(kernels, [])
        monkeypatch.setattr(decode_attention.triton, "launch", functools.partial(_counted, calls, original))
        policy = registry.get(name, **params)
        runs[kernels] = pipeline.generate(model, None, context, question, policy, max_new_tokens=NEW)
    launches = {k: len(v) for k, v in launches.items()}
    assert launches["torch"] == 0
    if "accumulate" in policy.observes:  # H2O's decode needs every row's probability: the reference path, by design
        assert launches["triton"] == 0
    else:
        assert launches["triton"] > 0  # the decode steps took the kernel
    assert runs["triton"].token_ids == runs["torch"].token_ids
    assert len(runs["triton"].token_ids) == NEW
    fetched = [s.last_step.get("rows_fetched", 0) for s in runs["triton"].stats.layers if s.last_step]
    torch_fetched = [s.last_step.get("rows_fetched", 0) for s in runs["torch"].stats.layers if s.last_step]
    assert fetched == torch_fetched  # the same rows were staged: the scans chose alike
