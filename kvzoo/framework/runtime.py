"""kvzoo's attention path: how a forward pass reads a ``TieredCache``.

transformers lets a model use a registered attention function by name. kvzoo registers one,
``"kvzoo"``, plus a matching mask function, and :func:`attach` switches a model to them (no
monkey-patching of modules, and :func:`detach` switches back). Per attention call:

1. ``TieredCache.update`` has just appended this forward's rows and returned the attended tier;
2. the attention function marks which new rows are padding (from the 2-D padding mask, indexed
   by slot), records the observation window's queries if the policy wants them, and attends
   over the tier with causality decided by slot (``kernels/attention.py``);
3. it adds the step's attention to the policy's accumulators when the policy asked for that;
4. it fires the policy's scheduled event (``step`` / ``block``) for this layer.

Handed any other cache (or none), the same function computes ordinary causal SDPA, so attaching
kvzoo to a model changes nothing for code that does not use a ``TieredCache``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from kvzoo.framework.cache import ACTIVE_LAYER, TieredLayer
from kvzoo.framework.retrieval import retrieve
from kvzoo.kernels.attention import attention_reference, attention_sdpa

ATTN_NAME = "kvzoo"


def padding_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor | None:
    """kvzoo's mask function: only the 2-D padding mask ``[B, kv_length]`` (True = real token).

    Causality is not encoded here: the attention function decides it per row from the row's slot,
    which stays right after rows are evicted (a 4-D mask indexed by tier position would not).
    """
    if attention_mask is None:
        return None
    mask = attention_mask[:, kv_offset : kv_offset + kv_length].to(torch.bool)
    if mask.shape[1] < kv_length:  # generate's mask can lag the cache by the new tokens
        pad = torch.ones(mask.shape[0], kv_length - mask.shape[1], dtype=torch.bool, device=mask.device)
        mask = torch.cat([mask, pad], dim=1)
    return None if bool(mask.all()) else mask


def kvzoo_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention over ``key``/``value`` (``[B, G, n, D]``) for ``query [B, H, q, D]``; returns ``[B, q, H, Dv]``."""
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    layer = ACTIVE_LAYER.get()
    ACTIVE_LAYER.set(None)
    if layer is None or key is not layer.keys:
        if layer is not None and layer.layer_idx == getattr(module, "layer_idx", None):
            raise RuntimeError(
                f"layer {layer.layer_idx}: the attention received keys that are not the TieredCache's attended tier "
                f"(the model transformed them after Cache.update); {type(module).__name__} is not supported"
            )
        return _plain_attention(query, key, value, attention_mask, scaling), None
    return tiered_attention(layer, query, attention_mask, scaling).transpose(1, 2).contiguous(), None


def _plain_attention(query, key, value, attention_mask, scaling) -> torch.Tensor:  # noqa: ANN001
    """Ordinary causal attention for a cache that is not a TieredCache (or no cache)."""
    B, _, q_len, _ = query.shape
    n = key.shape[2]
    if attention_mask is not None and attention_mask.dim() == 4:  # a caller-made mask: use it as is
        hpg = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(hpg, dim=1), value.repeat_interleave(hpg, dim=1)
        mask = attention_mask[..., :n]
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling)
        return out.transpose(1, 2).contiguous()
    slots = torch.arange(n, device=query.device).expand(B, key.shape[1], n)
    if attention_mask is not None:
        valid = attention_mask[:, -n:].to(torch.bool)[:, None, :].expand_as(slots)
    else:
        valid = torch.ones_like(slots, dtype=torch.bool)
    q_slots = torch.arange(n - q_len, n, device=query.device)
    out = attention_sdpa(query, key, value, slots, valid, q_slots, scaling)
    return out.transpose(1, 2).contiguous()


def tiered_attention(layer: TieredLayer, query: torch.Tensor, attention_mask, scaling: float) -> torch.Tensor:  # noqa: ANN001
    """Attention of ``query [B, H, q, D]`` over ``layer``'s attended tier; returns ``[B, H, q, Dv]``.

    The rows of this forward must already be appended (``layer.update``). Fires the policy's
    scheduled event for the layer afterwards.
    """
    ACTIVE_LAYER.set(None)
    policy = layer.cache.policy
    q_len = query.shape[2]
    layer.scaling = scaling
    layer.mark_padding(attention_mask if attention_mask is not None and attention_mask.dim() == 2 else None)
    layer.record_queries(query, policy.observation_window)
    q_slots = torch.arange(layer.seen - q_len, layer.seen, device=query.device)
    n = layer.num_rows
    # attended tier + the archived rows the retriever fetches back for this forward (if any)
    keys, values, slots, valid = retrieve(layer, query, q_slots, scaling)
    if "accumulate" in policy.observes:
        out, sums = attention_reference(query, keys, values, slots, valid, q_slots, scaling, column_sums=True)
        layer.row_stats["attention"] += sums[..., :n]  # fetched rows are not resident: no accumulator
    elif values.shape[-1] != keys.shape[-1]:
        # MLA (576-dim keys, 512-dim latent values): batched matmuls over the one shared group, in
        # query chunks; SDPA would copy the group out to every head and, with unequal key/value
        # widths, fall back to materialising the whole score matrix (3 GB at 8k tokens).
        out, _ = attention_reference(query, keys, values, slots, valid, q_slots, scaling)
    else:
        all_valid = layer.no_padding and keys.shape[2] == n
        out = attention_sdpa(query, keys, values, slots, valid, q_slots, scaling, all_valid=all_valid)
    layer.after_forward()
    return out


def register() -> None:
    """Register kvzoo's attention and mask functions with transformers (idempotent)."""
    AttentionInterface.register(ATTN_NAME, kvzoo_attention)
    AttentionMaskInterface.register(ATTN_NAME, padding_mask)


def attach(model: torch.nn.Module) -> None:
    """Make ``model`` use kvzoo's attention; remembers the previous implementation for :func:`detach`.

    Every model switches to the registered ``"kvzoo"`` attention and mask functions; an MLA
    adapter additionally runs its layers' forward itself (``MLAAdapter.attach``, which
    ``TieredCache`` calls).
    """
    register()
    config = model.config
    if config._attn_implementation == ATTN_NAME:
        return
    config._kvzoo_previous_attn = config._attn_implementation
    model.set_attn_implementation(ATTN_NAME)


def detach(model: torch.nn.Module) -> None:
    """Restore the attention implementation (and MLA forwards) ``model`` had before :func:`attach`."""
    from kvzoo.framework.adapters import MLAAdapter

    MLAAdapter.detach(model)
    previous = getattr(model.config, "_kvzoo_previous_attn", None)
    if previous is not None:
        model.set_attn_implementation(previous)
        del model.config._kvzoo_previous_attn
