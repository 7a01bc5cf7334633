"""MLA adapter (DeepSeek-V2/V3, Kimi Linear's MLA layers): one 576-dim latent row per token.

While attached, kvzoo runs the forward of each MLA attention module itself (the module's own
forward is kept and restored by ``detach``; with a cache that is not a ``TieredCache`` the
module's own forward runs unchanged). Per token and layer the cache holds one row

    row = [c (kv_lora_rank, after kv_a_layernorm) ; r (qk_rope_head_dim)]      # 512 + 64 = 576

shared by all heads -- never decompressed per-head K/V. Attention is computed in absorbed form
(DeepSeek-V2 §2.1.2): with ``kv_b_proj.weight`` viewed as ``[H, nope + v, kv_lora_rank]``,

    q_c'  = W_UK^T q_nope                  [B, H, q, 512]
    score = scale * <[q_c' ; q_r], row>    (one KV group: every head reads the same rows)
    o_lat = softmax(score) @ c             [B, H, q, 512]
    out   = W_UV o_lat                     [B, H, q, v]   -> o_proj

with the model's own softmax scale (DeepSeek-V2-Lite: 192^-1/2 * yarn mscale^2 = 0.11472).
DeepSeek rotates ``r`` (and ``q_r``) with RoPE at the true position *before* caching (the
control arm of VestigeKV); Kimi Linear never rotates it (NoPE). Kimi's KDA layers keep
transformers' own linear-attention cache layers (fixed-size state).
"""

from __future__ import annotations

import math
import sys
from typing import Any, ClassVar

import torch
import transformers

try:  # Kimi Linear's KDA layers (transformers >= 5.18); the transformers kvpress pins (< 5.3) has no such layer
    from transformers.cache_utils import LinearAttentionLayer
except ImportError:
    LinearAttentionLayer = None

from kvzoo.framework.adapters.base import Geometry
from kvzoo.framework.attention import MLAQuery, mla_attention
from kvzoo.framework.names import adapter_class
from kvzoo.framework.policy import Policy


def _version_tuple(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def check_transformers_for(model_type: str, version: str = transformers.__version__) -> None:
    """Raise if this transformers is older than the adapter serving ``model_type`` needs: its class's
    ``min_transformers`` (Kimi Linear: 5.18), if it has one."""
    cls = adapter_class(model_type)
    need = getattr(cls, "min_transformers", None)
    if need is not None and _version_tuple(version) < tuple(need):
        need = ".".join(map(str, need))
        raise RuntimeError(
            f"{getattr(cls, 'family', cls.name)} needs transformers >= {need} (native classes of its models); this "
            f"environment has {version}. Upgrade with: pip install 'transformers>={need}'"
        )


def decompress_break_even(dc: int, dr: int, nope: int, v: int) -> int:
    """Queries from which a forward attends faster decompressed than absorbed (FLOPs per head).

    Absorbed, each (query, row) costs ``(dc + dr) + dc`` multiply-adds (scores over the 576-dim
    row, the 512-dim latent value); decompressed, ``(nope + dr) + v``, plus ``dc * (nope + v)``
    per row once to decompress it. Equal at ``q = dc (nope + v) / (2 dc + dr - nope - dr - v)``:
    171 queries on the DeepSeek-V2-Lite / Kimi Linear row (512 + 64, nope 128, v 128).
    """
    saved = (2 * dc + dr) - (nope + dr + v)
    if saved <= 0:
        return 2
    return max(2, math.ceil(dc * (nope + v) / saved))


class MLAAdapter:
    """The MLA layers of a model: one latent row per token and layer, attended in absorbed form.

    A family says how its branch ``r`` is rotated (:meth:`rotate`, called in kvzoo's forward before the row is
    cached) and, when some layers are not MLA, what cache layer they keep (:meth:`untiered_layer`).
    """

    name: ClassVar[str] = "mla"
    family: ClassVar[str] = "MLA"  # for messages
    model_types: ClassVar[tuple[str, ...]] = ()
    layout = "mla"
    rotated_branch: ClassVar[bool] = True
    min_transformers: ClassVar[tuple[int, int] | None] = None  # the oldest transformers whose classes it runs on

    def __init__(self, model: torch.nn.Module, policy: Policy) -> None:
        config = model.config.get_text_config(decoder=True)
        num_layers = config.num_hidden_layers
        layer_types = getattr(config, "layer_types", None) or ["full_attention"] * num_layers
        mla_layers = tuple(i for i, t in enumerate(layer_types) if t == "full_attention")
        self.geometry = Geometry(
            "mla", num_layers, mla_layers, config.num_attention_heads, 1, config.kv_lora_rank,
            config.qk_rope_head_dim, self.branch_is_rotated(config),
            decompress_break_even(config.kv_lora_rank, config.qk_rope_head_dim, config.qk_nope_head_dim,
                                  config.v_head_dim),
        )
        self.modules = {}
        for module in model.modules():
            idx = getattr(module, "layer_idx", None)
            if idx in mla_layers and hasattr(module, "kv_b_proj") and hasattr(module, "kv_a_proj_with_mqa"):
                self.modules[idx] = module
        missing = sorted(set(mla_layers) - set(self.modules))
        if missing:
            raise ValueError(f"{type(model).__name__}: no MLA attention module found for layers {missing}")

    @classmethod
    def branch_is_rotated(cls, config: Any) -> bool:
        """Whether this family's branch ``r`` carries RoPE in the cache (the class's ``rotated_branch``)."""
        return cls.rotated_branch

    @staticmethod
    def rotate(module: torch.nn.Module, q_r: torch.Tensor, r: torch.Tensor, position_embeddings: Any):
        """``(q_r, r)`` rotated as the family's own forward rotates them (here: not at all)."""
        return q_r, r

    def attention_modules(self) -> dict[int, torch.nn.Module]:
        return dict(self.modules)

    def untiered_layer(self, layer_idx: int) -> Any:
        raise ValueError(f"{type(self).__name__}: every layer is MLA (layer {layer_idx} asked for)")

    def attach(self) -> None:
        for module in self.modules.values():
            if getattr(module, "_kvzoo_original_forward", None) is None:
                module._kvzoo_original_forward = module.forward
                module._kvzoo_rotate = self.rotate
                module.forward = _mla_forward.__get__(module)


class DeepSeekV2MLAAdapter(MLAAdapter):
    """DeepSeek-V2: the branch rotated at its true position before caching, in interleaved pairs (complex form)."""

    name = "deepseek_v2"
    model_types = ("deepseek_v2",)

    @staticmethod
    def rotate(module: torch.nn.Module, q_r: torch.Tensor, r: torch.Tensor, position_embeddings: Any):
        return sys.modules[type(module).__module__].apply_rotary_emb(q_r, r, position_embeddings)


class DeepSeekV3MLAAdapter(MLAAdapter):
    """DeepSeek-V3: the branch rotated before caching (interleaved or half-split, as its config says)."""

    name = "deepseek_v3"
    model_types = ("deepseek_v3",)

    @staticmethod
    def rotate(module: torch.nn.Module, q_r: torch.Tensor, r: torch.Tensor, position_embeddings: Any):
        modeling = sys.modules[type(module).__module__]
        cos, sin = position_embeddings
        if module.config.rope_interleave:
            return modeling.apply_rotary_pos_emb_interleave(q_r, r, cos, sin)
        return modeling.apply_rotary_pos_emb(q_r, r, cos, sin)


class KimiMLAAdapter(MLAAdapter):
    """Kimi Linear: MLA layers whose branch is never rotated (NoPE); its KDA layers keep transformers' own
    linear-attention cache layers (a fixed-size state)."""

    name = "kimi_linear"
    family = "Kimi Linear"
    model_types = ("kimi_linear",)
    rotated_branch = False
    min_transformers = (5, 18)  # its native KimiLinear classes and linear-attention cache layers

    def __init__(self, model: torch.nn.Module, policy: Policy) -> None:
        check_transformers_for(self.model_types[0])
        super().__init__(model, policy)
        if len(self.geometry.tiered) < self.geometry.num_layers and LinearAttentionLayer is None:
            need = ".".join(map(str, self.min_transformers))
            raise RuntimeError(
                f"{type(model).__name__} has linear-attention layers, whose cache layer needs transformers >= {need} "
                f"(this is {transformers.__version__}): pip install 'transformers>={need},<5.40'"
            )

    def untiered_layer(self, layer_idx: int) -> Any:
        return LinearAttentionLayer()


def _mla_forward(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    *args: Any,
    attention_mask: torch.Tensor | None = None,
    cache: Any = None,
    position_embeddings: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """kvzoo's forward of one MLA attention module: latent rows in, absorbed or decompressed attention.

    A kvzoo cache says so by answering ``kvzoo_layer(layer_idx)`` (the layer whose store receives the
    rows); any other cache gets the module's own forward.
    """
    if "past_key_values" in kwargs and cache is None:
        cache = kwargs.pop("past_key_values")
    if args:  # DeepSeek-V3 takes position_embeddings positionally
        position_embeddings, *rest = args
        if rest:
            attention_mask = rest[0]
    layer = cache.kvzoo_layer(self.layer_idx) if hasattr(cache, "kvzoo_layer") else None
    if layer is None:
        return self._kvzoo_original_forward(
            hidden_states, attention_mask=attention_mask, cache=cache, position_embeddings=position_embeddings, **kwargs
        ) if position_embeddings is not None else self._kvzoo_original_forward(
            hidden_states, attention_mask=attention_mask, cache=cache, **kwargs
        )
    layer.check_owner(self, appended=False)  # before any row goes in: another model's MLA module is refused
    B, q_len = hidden_states.shape[:2]
    if self.q_lora_rank is None:
        q = self.q_proj(hidden_states)
    else:
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
    q = q.view(B, q_len, self.num_heads, self.qk_head_dim).transpose(1, 2)
    q_nope, q_r = torch.split(q, [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
    c, r = torch.split(self.kv_a_proj_with_mqa(hidden_states), [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
    c = self.kv_a_layernorm(c).view(B, 1, q_len, self.kv_lora_rank)
    r = r.view(B, 1, q_len, self.qk_rope_head_dim)
    q_r, r = self._kvzoo_rotate(self, q_r, r, position_embeddings)
    row = torch.cat([c, r.to(c.dtype)], dim=-1)  # [B, 1, q, 576]
    cache.update(row, None, self.layer_idx, kwargs={})  # kwargs: the layer names itself there, no context variable
    query = MLAQuery(q_nope, q_r, self.kv_b_proj.weight, self.v_head_dim, self.scaling)
    out = mla_attention(layer, query, attention_mask, layer.decompress_min_queries)  # [B, H, q, v]
    return self.o_proj(out.transpose(1, 2).reshape(B, q_len, -1)), None
