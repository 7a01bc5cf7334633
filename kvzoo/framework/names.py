"""Names to objects for the framework: the one seam where ``framework/`` reaches the registry.

``TieredCache(model, "quest")`` and ``policy.retriever = "vestige"`` name things; the registry
(``kvzoo/registry.py``, above the framework) knows what the names mean, plugins included. Every
lookup the framework makes goes through this module, so the arrow from the framework up to the
registry is exactly one (``tests/test_layers.py`` holds it to that).
"""

from __future__ import annotations

from typing import Any

from kvzoo import registry
from kvzoo.framework.policy import Policy
from kvzoo.framework.retriever import Retriever


def resolve_policy(policy: Policy | str | None) -> Policy:
    """A Policy from a Policy, a registered name or spec (``"quest(gqa=group)"``), or None (``full``)."""
    return registry.resolve(policy)


def build_retriever(spec: str | Retriever | None, **params: Any) -> Retriever | None:
    """A configured retriever from a registered name (with ``params``), a Retriever object, or None."""
    return registry.build_retriever(spec, **params)


def policy_retriever(policy: Policy) -> Retriever | None:
    """The retriever ``policy`` names, configured with what the policy holds for it (its ``page_size``)."""
    retriever = policy.retriever
    if isinstance(retriever, str):
        retriever = registry.build_retriever(retriever, **{name: getattr(policy, name) for name in policy.retriever_fields})
    registry.check_retriever_params(policy, retriever)
    return retriever


def adapter_class(model_type: str | None) -> type:
    """The registered adapter class serving ``model_type`` (a ValueError naming the supported ones if none)."""
    return registry.adapter_class(model_type)
