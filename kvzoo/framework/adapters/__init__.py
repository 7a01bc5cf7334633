"""Model adapters: what kvzoo needs to know about a model family to run its attention.

A family is a plugin: an :class:`Adapter` class registered through the ``kvzoo_adapters`` hook, naming the
transformers ``model_types`` it serves (built in: GQA/MHA, ``gqa.py``; DeepSeek-V2/V3 and Kimi Linear's MLA,
``mla.py``). It states the family's :class:`Geometry`; ``TieredCache`` asks it, and nothing else, about the model.
"""

from __future__ import annotations

import torch

from kvzoo.framework.adapters.base import Adapter, Geometry, adapter_problem
from kvzoo.framework.names import adapter_class
from kvzoo.framework.plugins import plugin_failed
from kvzoo.framework.policy import Policy


def model_type_of(model: torch.nn.Module) -> str | None:
    """The decoder's ``config.model_type`` (a multimodal model's text config)."""
    config = getattr(model, "config", None)
    return getattr(getattr(config, "get_text_config", lambda **_: config)(decoder=True), "model_type", None)


def adapter_for(model: torch.nn.Module, policy: Policy) -> Adapter:
    """The registered adapter of ``model``'s family, built for ``policy``; a ValueError when there is none or the
    policy does not support the family's layout."""
    model_type = model_type_of(model)
    try:
        cls = adapter_class(model_type)
    except ValueError as err:
        raise ValueError(f"{type(model).__name__}: {err}") from None
    if cls.layout not in policy.layouts:
        raise ValueError(
            f"policy {policy.name!r} supports layouts {policy.layouts}, but {type(model).__name__} is {cls.layout!r}"
        )
    try:  # a family is a plugin: its fault names it
        return cls(model, policy)
    except Exception as err:
        plugin_failed(cls, ADAPTER, "__init__", err)


ADAPTER = "model-family adapter"  # what an error calls an adapter plugin (kvzoo.framework.plugins.plugin_label)


__all__ = ["ADAPTER", "Adapter", "Geometry", "adapter_for", "adapter_problem", "model_type_of"]
