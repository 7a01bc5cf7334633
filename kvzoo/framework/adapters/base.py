"""What a model family states (:class:`Geometry`) and provides (:class:`Adapter`); imports nothing above the
policy layer, so the registry can check an adapter class without reaching back into the framework."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch

from kvzoo.framework.policy import LAYOUTS


@dataclass(frozen=True)
class Geometry:
    """A model family's rows, as the cache and the runtime need them."""

    layout: str  # "gqa": a row is one KV head's key and value; "mla": one latent row shared by every head
    num_layers: int  # decoder layers (every one gets a cache layer)
    tiered: tuple[int, ...]  # the layers kvzoo compresses (Kimi Linear: its MLA layers; the rest keep their own)
    num_heads: int  # query heads
    groups: int  # KV groups per layer: GQA the KV heads, MLA 1 (every head reads the same rows)
    content_dim: int = 0  # MLA: the latent c's width (512); GQA: 0 (the whole key is content)
    branch_dim: int = 0  # MLA: the decoupled branch r's width (64); GQA: 0
    rotated_branch: bool = True  # the cached keys (GQA) or branch r (MLA) carry RoPE at their position (Kimi: no)
    decompress_min_queries: int | None = None  # MLA: queries from which a forward attends decompressed


class Adapter(Protocol):
    """What a model family provides. Registered by class (``kvzoo_adapters``); built as ``cls(model, policy)``.

    ``attach()`` installs kvzoo's attention on the model (idempotent; GQA: nothing to replace, MLA: the
    module's forward); ``attention_modules()`` maps each tiered layer to the module whose forwards reach the
    cache (a cache is bound to them); ``untiered_layer(i)`` is the transformers cache layer of a layer kvzoo
    does not compress (only called for layers outside ``geometry.tiered``). Optional: ``min_transformers``, the
    oldest transformers ``(major, minor)`` whose classes the family runs on (checked before a cache or a tiny model
    is built, :func:`kvzoo.framework.adapters.mla.check_transformers_for`), and ``family``, its name in messages.
    """

    name: ClassVar[str]
    model_types: ClassVar[tuple[str, ...]]
    layout: ClassVar[str]
    geometry: Geometry

    def attach(self) -> None: ...

    def attention_modules(self) -> dict[int, torch.nn.Module]: ...

    def untiered_layer(self, layer_idx: int) -> Any: ...


def adapter_problem(cls: type) -> str | None:
    """Why ``cls`` is not an adapter class the registry can take (None: it is)."""
    types = getattr(cls, "model_types", None)
    if isinstance(types, str) or not isinstance(types, tuple) or not types or not all(isinstance(t, str) for t in types):
        return f"needs model_types: ClassVar[tuple[str, ...]], the transformers model types it serves (got {types!r})"
    if getattr(cls, "layout", None) not in LAYOUTS:
        return f"needs layout: ClassVar[str], one of {LAYOUTS} (got {getattr(cls, 'layout', None)!r})"
    missing = [m for m in ("attach", "attention_modules", "untiered_layer") if not callable(getattr(cls, m, None))]
    if missing:
        return f"has no {', '.join(missing)} (see kvzoo.framework.adapters.Adapter)"
    return None
