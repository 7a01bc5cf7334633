"""Model adapters: what kvzoo needs to know about a model family to run its attention.

``adapter_for(model, policy)`` returns the adapter or raises a ValueError naming the supported
architectures. GQA/MHA (Llama family) in ``gqa.py``; MLA (DeepSeek-V2/V3, Kimi Linear) in ``mla.py``.
"""

from __future__ import annotations

import torch

from kvzoo.framework.adapters.gqa import GQA_MODEL_TYPES, GQAAdapter
from kvzoo.framework.adapters.mla import MLA_MODEL_TYPES, MLAAdapter
from kvzoo.framework.policy import Policy

SUPPORTED_MODEL_TYPES: tuple[str, ...] = GQA_MODEL_TYPES + MLA_MODEL_TYPES


def adapter_for(model: torch.nn.Module, policy: Policy) -> GQAAdapter | MLAAdapter:
    config = getattr(model, "config", None)
    model_type = getattr(getattr(config, "get_text_config", lambda **_: config)(decoder=True), "model_type", None)
    if model_type in GQA_MODEL_TYPES:
        adapter = GQAAdapter(model, record_inputs="inputs" in policy.observes)
    elif model_type in MLA_MODEL_TYPES:
        adapter = MLAAdapter(model)
    else:
        raise ValueError(
            f"kvzoo does not support model_type={model_type!r} ({type(model).__name__}); "
            f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    if adapter.layout not in policy.layouts:
        raise ValueError(
            f"policy {policy.name!r} supports layouts {policy.layouts}, but {type(model).__name__} is {adapter.layout!r}"
        )
    return adapter


__all__ = ["adapter_for", "GQAAdapter", "MLAAdapter", "SUPPORTED_MODEL_TYPES"]
