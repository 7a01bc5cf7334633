"""kvzoo: a zoo of KV-cache policies on one tiered-cache runtime.

    from kvzoo import registry, pipeline, TieredCache
    policy = registry.get("streaming_llm", ratio=4)
    result = pipeline.generate(model, tokenizer, context, question, policy)
"""

from kvzoo.framework.cache import CacheStats, TieredCache
from kvzoo.framework.policy import Policy, RowsView

__version__ = "0.1.0"

__all__ = ["TieredCache", "CacheStats", "Policy", "RowsView", "__version__"]
