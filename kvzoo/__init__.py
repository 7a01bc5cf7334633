"""kvzoo: a zoo of KV-cache policies on one tiered-cache runtime.

    import kvzoo
    policy = kvzoo.registry.get("streaming_llm", ratio=4)
    result = kvzoo.pipeline.generate(model, tokenizer, context, question, policy)

Every name below is imported on first use (PEP 562), so ``import kvzoo`` and ``kvzoo --version`` need neither torch
nor transformers; the policy layer needs torch alone, ``pipeline``, ``TieredCache`` and ``models`` transformers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# name -> (module, attribute); attribute None: the module itself
_LAZY: dict[str, tuple[str, str | None]] = {
    "registry": ("kvzoo.registry", None),
    "pipeline": ("kvzoo.pipeline", None),
    "models": ("kvzoo.models", None),
    "bench": ("kvzoo.bench", None),
    "TieredCache": ("kvzoo.framework.cache", "TieredCache"),
    "CacheStats": ("kvzoo.framework.stats", "CacheStats"),
    "Policy": ("kvzoo.framework.policy", "Policy"),
    "RowsView": ("kvzoo.framework.policy", "RowsView"),
    "Retriever": ("kvzoo.framework.retriever", "Retriever"),
    "load_smollm2": ("kvzoo.models", "load_smollm2"),
}

__all__ = [  # the names of _LAZY, written out (static analysers read a literal list)
    "__version__", "registry", "pipeline", "models", "bench", "TieredCache", "CacheStats", "Policy", "RowsView",
    "Retriever", "load_smollm2",
]

if TYPE_CHECKING:  # for type checkers and IDEs: the same names, imported eagerly
    from kvzoo import bench, models, pipeline, registry
    from kvzoo.framework.cache import TieredCache
    from kvzoo.framework.policy import Policy, RowsView
    from kvzoo.framework.retriever import Retriever
    from kvzoo.framework.stats import CacheStats
    from kvzoo.models import load_smollm2


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'kvzoo' has no attribute {name!r} (it has: {', '.join(__all__)})")
    module_name, attribute = _LAZY[name]
    module = importlib.import_module(module_name)
    value = module if attribute is None else getattr(module, attribute)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
