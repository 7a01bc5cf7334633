"""kvzoo: a zoo of KV-cache policies on one tiered-cache runtime.

    from kvzoo import registry, pipeline, TieredCache
    policy = registry.get("streaming_llm", ratio=4)
    result = pipeline.generate(model, tokenizer, context, question, policy)

Importing ``kvzoo`` (or its policy layer, ``kvzoo.framework.policy`` and ``kvzoo.policies.*``) needs
torch alone; the names below that need transformers are imported on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "TieredCache": "kvzoo.framework.cache",
    "CacheStats": "kvzoo.framework.stats",
    "Policy": "kvzoo.framework.policy",
    "RowsView": "kvzoo.framework.policy",
}

__all__ = ["TieredCache", "CacheStats", "Policy", "RowsView", "__version__"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kvzoo' has no attribute {name!r}")
