"""kvzoo's attention path: how a forward pass reads a ``TieredCache``.

kvzoo registers an attention function and a mask function named ``"kvzoo"`` with transformers, and :func:`attach`
switches a model to them (no monkey-patching; :func:`detach` switches back); MLA layers call :func:`mla_attention`
from the adapter's forward. A decode step reads the tier in place through one decode-attention op with the
retriever's rows in the same softmax (:func:`decode_step`); a multi-token forward goes through SDPA (MLA
decompressing the rows to per-head K/V first, as FlashMLA and vLLM prefill); then the runtime fires the policy's
scheduled event. Handed any other cache, the function is ordinary causal SDPA (docs/runtime-and-kernels.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from kvzoo.framework.layer import ACTIVE_LAYER, KVLayer
from kvzoo.framework.memory import release_freed
from kvzoo.framework.policy import sinks_and_recent
from kvzoo.kernels.attention import attention_reference, attention_sdpa
from kvzoo.kernels.decode_attention import attend

ATTN_NAME = "kvzoo"


def after_forward(layer: KVLayer) -> None:
    """The runtime's schedule after the layer's attention (:meth:`Runtime.after_forward`); when the forward ended the
    context, the heap's free pages go back before the next layer runs if the rows the layer dropped, or the rows the
    forward brought it (its attention's and feed-forward's activations scale with them), reach the threshold of
    :func:`~kvzoo.framework.memory.release_freed`."""
    freed = layer.runtime.after_forward(layer)
    if freed is not None:
        release_freed(max(freed, layer.store.brought_bytes()))


def padding_mask(
    batch_size: int,
    q_length: int | None = None,
    kv_length: int = 0,
    q_offset: int = 0,
    kv_offset: int = 0,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor | None:
    """kvzoo's mask function: only the 2-D padding mask ``[B, kv_length]`` (True = real token); transformers < 5.3
    passes ``cache_position`` instead of ``q_length``.

    Causality is decided by the attention from each row's slot, which stays right after rows are evicted (a 4-D mask
    indexed by tier position would not). A decode step gets the mask unchecked, so it never waits for the device.
    """
    if q_length is None:
        q_length = kwargs["cache_position"].shape[0]
    if attention_mask is None:
        return None
    mask = attention_mask[:, kv_offset : kv_offset + kv_length].to(torch.bool)
    if mask.shape[1] < kv_length:  # generate's mask can lag the cache by the new tokens
        pad = torch.ones(mask.shape[0], kv_length - mask.shape[1], dtype=torch.bool, device=mask.device)
        mask = torch.cat([mask, pad], dim=1)
    if q_length > 1 and bool(mask.all()):
        return None
    return mask


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
    # the layer whose update() just ran: transformers >= 5.3 hands update() this call's keyword arguments and the
    # layer names itself there; older versions leave it in ACTIVE_LAYER (framework/layer.py)
    layer = kwargs.pop("kvzoo_layer", None)
    if layer is None and ACTIVE_LAYER.get() is not None:  # transformers < 5.3
        layer = ACTIVE_LAYER.get()
        ACTIVE_LAYER.set(None)
    returned = layer.returned() if layer is not None and layer.returned is not None else None
    if layer is None or key is not returned:
        if (layer is not None and layer.layer_idx == getattr(module, "layer_idx", None)
                and returned is not None and key.shape == returned.shape):
            raise RuntimeError(
                f"layer {layer.layer_idx}: the attention received keys that are not the TieredCache's attended tier "
                f"(the model transformed them after Cache.update); {type(module).__name__} is not supported"
            )
        return _plain_attention(query, key, value, attention_mask, scaling, kwargs.get("sliding_window")), None
    layer.check_owner(module, appended=True)  # another model's attention (one that had a TieredCache too)
    out = tiered_attention(layer, query, attention_mask, scaling)
    return out.transpose(1, 2).contiguous(), None


def _plain_attention(query, key, value, attention_mask, scaling, sliding_window: int | None = None) -> torch.Tensor:
    """Ordinary causal attention for a cache that is not a TieredCache (or no cache), and for a hybrid model's
    sliding-window layers (kept in transformers' sliding-window cache layer: its rows are the last ones, in order):
    a query sees the rows fewer than ``sliding_window`` positions behind it, as transformers' sliding mask says."""
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
    if sliding_window is not None and n > sliding_window:  # some row is out of some query's window
        return _windowed_attention(query, key, value, slots, valid, q_slots, scaling, sliding_window,
                                   attention_mask is None)
    out = attention_sdpa(query, key, value, slots, valid, q_slots, scaling, all_valid=attention_mask is None)
    return out.transpose(1, 2).contiguous()


# queries per block of a long sliding-window forward (_windowed_attention): 1,024 computed 3x the scores a 512-row
# window needs (a Gemma-3-270M layer at 8k, 1 thread: 0.72 s; 256: 0.38 s)
WINDOW_BLOCK = 256


def _windowed_attention(query, key, value, slots, valid, q_slots, scaling, window: int,
                        all_valid: bool) -> torch.Tensor:
    """Sliding-window attention of a long forward, :data:`WINDOW_BLOCK` queries at a time over only the rows their
    windows reach (``block + window - 1`` at most): memory ``O(block x (block + window))``, never ``[q, n]`` -- at 32k tokens
    a whole mask and SDPA's scores over it would take ~20 GB. Returns ``[B, q, H, Dv]``."""
    q_len, n, block = query.shape[2], key.shape[2], WINDOW_BLOCK
    outs = []
    for start in range(0, q_len, block):
        end = min(q_len, start + block)
        qs = q_slots[start:end]  # slots n - q_len + start ... n - q_len + end - 1 (read from the shapes: no sync)
        lo, hi = max(0, n - q_len + start - window + 1), n - q_len + end  # the rows these queries' windows reach
        near = (qs[:, None] - slots[0, 0, lo:hi][None, :]) < window  # [b, hi - lo]
        outs.append(attention_sdpa(query[:, :, start:end], key[:, :, lo:hi], value[:, :, lo:hi], slots[..., lo:hi],
                                   valid[..., lo:hi], qs, scaling, all_valid=all_valid, extra_mask=near))
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous()


# --- the tiered path ---------------------------------------------------------------------------------


def _begin(layer: KVLayer, attention_mask: torch.Tensor | None, scaling: float) -> None:
    layer.runtime.pending = None  # this layer's attention runs through kvzoo
    layer.observed.scaling = scaling
    if attention_mask is not None and attention_mask.dim() == 2:  # a padding mask: which of the new rows are real
        layer.store.mark_padding(attention_mask)


def _query_slots(layer: KVLayer, q_len: int, device: torch.device) -> torch.Tensor:
    return torch.arange(layer.counts.seen - q_len, layer.counts.seen, device=device)


@dataclass
class MultiTokenRows:
    """The rows a multi-token forward attends over: the ordered tier and the fetched rows (if any), after the tier
    -- or before it for the whole archive (``"dense"``: all older than the forward's rows, so bottom-right causal
    still holds)."""

    keys: torch.Tensor
    values: torch.Tensor
    slots: torch.Tensor
    valid: torch.Tensor
    tier: slice  # where the tier's rows are
    plain_causal: bool  # no padding, the forward's rows last, all others visible: bottom-right causal is exact


def _multi_rows(layer: KVLayer, index_query: Callable[[], torch.Tensor], scaling: float) -> MultiTokenRows:
    """The ordered tier plus what the retriever fetches for ``index_query()`` (built only if it scans)."""
    rt = layer.runtime
    store = layer.store
    store.ensure_order()  # the forward's own rows last, every older row before them
    keys, values = store.get("keys"), store.get("values")
    slots, valid = store.get("slots"), store.get("valid")
    fetched = None
    if store.archive.index is not None and store.archive.positions.n > 0:
        fetched = rt.retrieval.fetch_forward(layer, index_query(), scaling)
    else:
        layer.counts.attended(store.n)
    n = store.n
    if fetched is None:
        return MultiTokenRows(keys, values, slots, valid, slice(0, n), store.all_valid)
    f_values = fetched.values if fetched.values is not None else fetched.keys[..., :values.shape[-1]]
    if fetched.dense:
        m = fetched.keys.shape[2]
        return MultiTokenRows(
            torch.cat([fetched.keys, keys], dim=2), torch.cat([f_values, values], dim=2),
            torch.cat([fetched.slots, slots], dim=2), torch.cat([fetched.valid, valid], dim=2), slice(m, m + n),
            store.all_valid,
        )
    return MultiTokenRows(
        torch.cat([keys, fetched.keys], dim=2), torch.cat([values, f_values], dim=2),
        torch.cat([slots, fetched.slots], dim=2), torch.cat([valid, fetched.valid], dim=2), slice(0, n), False,
    )


def _window_mask(layer: KVLayer, rows: MultiTokenRows, q_len: int, groups: int) -> torch.Tensor | None:
    """The policy's per-token window over the tier's rows for a multi-token forward (None: none)."""
    rt = layer.runtime
    if layer.rank < rt.policy.dense_layers:
        return None
    budget = rt.resolve_budget(layer)
    window = rt.policy.multi_token_window(budget) if budget is not None else None
    if window is None:
        return None
    tier_slots, tier_valid = layer.store.get("slots"), layer.store.get("valid")
    q_slots = _query_slots(layer, q_len, tier_slots.device)
    mask = torch.ones(*rows.valid.shape[:2], q_len, rows.valid.shape[2], dtype=torch.bool, device=tier_valid.device)
    sinks, recent = window
    mask[..., rows.tier] = sinks_and_recent(tier_slots, tier_valid, sinks, recent, query_slots=q_slots).expand(
        rows.valid.shape[0], groups, -1, -1)
    return mask


def _multi(layer: KVLayer, query: torch.Tensor, rows: MultiTokenRows, scaling: float, *, sdpa: bool) -> torch.Tensor:
    """A multi-token forward over ``rows``: ``[B, H, q, Dv]``."""
    q_slots = _query_slots(layer, query.shape[2], query.device)
    extra = _window_mask(layer, rows, query.shape[2], rows.valid.shape[1]) if query.shape[2] > 1 else None
    if layer.runtime.accumulates:
        out, sums = attention_reference(query, rows.keys, rows.values, rows.slots, rows.valid, q_slots, scaling,
                                        column_sums=True, extra_mask=extra, bottom_right=rows.plain_causal)
        layer.store.accumulate(sums[..., rows.tier], step=False)
        return out
    if sdpa:
        return attention_sdpa(query, rows.keys, rows.values, rows.slots, rows.valid, q_slots, scaling,
                              all_valid=rows.plain_causal, extra_mask=extra)
    out, _ = attention_reference(query, rows.keys, rows.values, rows.slots, rows.valid, q_slots, scaling,
                                 extra_mask=extra)
    return out


def decode_step(layer: KVLayer, query: torch.Tensor, scaling: float) -> torch.Tensor:
    """Attention of one query per sequence ``[B, H, 1, D]`` over the layer's rows: ``[B, H, 1, Dv]``.

    The tier is read where its rows lie; with an index, the op over the tier gives its best score (s*), the
    retriever names a fixed count of rows and the op over them joins the tier's part in one softmax. No Python
    number that changes from step to step reaches an op, so a CUDA graph can capture it (``tests/test_static_step.py``).
    """
    rt = layer.runtime
    q = query[:, :, 0]
    store = layer.store
    tier = store.source()
    accumulate = rt.accumulates
    archive = store.archive
    index = archive.index if archive.index is not None and archive.positions.n else None
    if index is None:
        part = attend(q, [tier], scaling, mass=accumulate)
        layer.counts.attended(store.n)
    else:  # the tier's scores first (s*: its best), then the rows the retriever names, in one softmax with them
        part = attend(q, [tier], scaling, best=index.needs_best, defer=True, mass=accumulate)
        best = part.best[..., None] if part.best is not None else None  # [B, H, 1]
        fetched = rt.retrieval.fetch_step(layer, query, best, scaling)
        part = attend(q, [fetched], scaling, prior=part, mass=accumulate)
    if accumulate:  # each tier row's probability in the step (the step's first source), over its group's heads
        store.accumulate(part.mass[0])
    return part.out.to(query.dtype)[:, :, None]


def tiered_attention(layer: KVLayer, query: torch.Tensor, attention_mask: torch.Tensor | None,
                     scaling: float) -> torch.Tensor:
    """GQA/MHA attention of ``query [B, H, q, D]`` over one layer's tiers (this forward's rows already appended);
    returns ``[B, H, q, Dv]`` and fires the policy's scheduled event."""
    rt = layer.runtime
    _begin(layer, attention_mask, scaling)
    window = rt.observation_window
    if window > 0 and not layer.context_ended:  # after the context's end no event reads them
        layer.observed.record_queries(query, window)
    if query.shape[2] == 1:
        out = decode_step(layer, query, scaling)
    else:
        out = _multi(layer, query, _multi_rows(layer, lambda: query, scaling), scaling, sdpa=True)
    after_forward(layer)
    return out


@dataclass
class MLAQuery:
    """One MLA layer's queries in both forms, and the weights that move between them.

    ``q_nope [B, H, q, nope]``, ``q_rope [B, H, q, dr]`` (rotated where the model rotates), and
    ``kv_weight`` = ``kv_b_proj.weight`` ``[H * (nope + v), dc]``, of which ``W_UK [H, nope, dc]``
    and ``W_UV [H, v, dc]`` are views.
    """

    q_nope: torch.Tensor
    q_rope: torch.Tensor
    kv_weight: torch.Tensor
    v_dim: int
    scaling: float

    @property
    def w_uk(self) -> torch.Tensor:
        H, nope = self.q_nope.shape[1], self.q_nope.shape[-1]
        return self.kv_weight.view(H, nope + self.v_dim, -1)[:, :nope]

    @property
    def w_uv(self) -> torch.Tensor:
        H, nope = self.q_nope.shape[1], self.q_nope.shape[-1]
        return self.kv_weight.view(H, nope + self.v_dim, -1)[:, nope:]

    def absorbed(self, last: int | None = None) -> torch.Tensor:
        """``[W_UK^T q_nope ; q_r]`` ``[B, H, q, dc + dr]`` (the last ``last`` queries only, if given)."""
        q_nope, q_rope = self.q_nope, self.q_rope
        if last is not None:
            q_nope, q_rope = q_nope[:, :, -last:], q_rope[:, :, -last:]
        q_c = torch.einsum("bhqn,hnc->bhqc", q_nope, self.w_uk)  # [B, H, q, dc]
        return torch.cat([q_c, q_rope.to(q_c.dtype)], dim=-1)

    def decompress(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head ``k = [W_UK c ; r]`` ``[B, H, n, nope + dr]`` and ``v = W_UV c`` ``[B, H, n, v]`` of latent rows."""
        dc = self.kv_weight.shape[-1]
        c, r = rows[:, 0, :, :dc], rows[:, 0, :, dc:]  # [B, n, dc], [B, n, dr]
        H, nope = self.q_nope.shape[1], self.q_nope.shape[-1]
        kv = F.linear(c, self.kv_weight).view(c.shape[0], c.shape[1], H, -1).transpose(1, 2)  # [B, H, n, nope + v]
        k_nope, v = kv[..., :nope], kv[..., nope:]
        keys = torch.cat([k_nope, r[:, None].expand(-1, H, -1, -1)], dim=-1)
        return keys, v

    def output(self, latent: torch.Tensor) -> torch.Tensor:
        """``W_UV`` applied to a latent output ``[B, H, q, dc]`` -> ``[B, H, q, v]``."""
        return torch.einsum("bhqc,hvc->bhqv", latent, self.w_uv)


def mla_attention(layer: KVLayer, mq: MLAQuery, attention_mask: torch.Tensor | None, threshold: int) -> torch.Tensor:
    """MLA attention over one layer's latent rows; returns ``[B, H, q, v]`` (before ``o_proj``): absorbed below
    ``threshold`` queries, decompressed to per-head K/V through SDPA above -- the same numbers, the cheaper way."""
    rt = layer.runtime
    _begin(layer, attention_mask, mq.scaling)
    q_len = mq.q_nope.shape[2]
    window = rt.observation_window
    if window > 0 and not layer.context_ended:  # after the context's end no event reads them
        layer.observed.record_queries(mq.absorbed(last=min(window, q_len)), window)
    if q_len == 1:
        latent = decode_step(layer, mq.absorbed(), mq.scaling)
        out = mq.output(latent)
    elif q_len < threshold:
        query = mq.absorbed()
        latent = _multi(layer, query, _multi_rows(layer, lambda: query, mq.scaling), mq.scaling, sdpa=False)
        out = mq.output(latent)
    else:
        rows = _multi_rows(layer, mq.absorbed, mq.scaling)  # the index is over latent rows: absorbed queries
        keys, values = mq.decompress(rows.keys)
        query = torch.cat([mq.q_nope, mq.q_rope.to(mq.q_nope.dtype)], dim=-1)
        B, H = query.shape[:2]
        slots = rows.slots.expand(B, H, -1)  # one latent group serves every head
        valid = rows.valid.expand(B, H, -1)
        per_head = MultiTokenRows(keys, values, slots, valid, rows.tier, rows.plain_causal)
        out = _multi(layer, query, per_head, mq.scaling, sdpa=True)
    after_forward(layer)
    return out


def register() -> None:
    """Register kvzoo's attention and mask functions with transformers (idempotent)."""
    AttentionInterface.register(ATTN_NAME, kvzoo_attention)
    AttentionMaskInterface.register(ATTN_NAME, padding_mask)


def attach(model: torch.nn.Module) -> None:
    """Make ``model`` use kvzoo's attention; remembers the previous implementation for :func:`detach`."""
    register()
    config = model.config
    if config._attn_implementation == ATTN_NAME:
        return
    config._kvzoo_previous_attn = config._attn_implementation
    model.set_attn_implementation(ATTN_NAME)


def detach(model: torch.nn.Module) -> None:
    """Restore the attention implementation (and MLA forwards) ``model`` had before :func:`attach`."""
    for module in model.modules():  # MLA layers whose forward an adapter replaced
        original = getattr(module, "_kvzoo_original_forward", None)
        if original is not None:
            module.forward = original
            del module._kvzoo_original_forward, module._kvzoo_rotate
    original = model.__dict__.pop("_kvzoo_original_model_forward", None)  # a CUDA-graph wrapper (framework/graphs.py)
    if original is not None:
        model.__dict__.pop("forward", None)  # the class's forward again
        model.__dict__.pop("_kvzoo_graphs", None)
    previous = getattr(model.config, "_kvzoo_previous_attn", None)
    if previous is not None:
        model.set_attn_implementation(previous)
        del model.config._kvzoo_previous_attn
