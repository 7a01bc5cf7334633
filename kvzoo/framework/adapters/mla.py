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
from typing import Any

import torch
import transformers

from kvzoo.framework.attention import MLAQuery, mla_attention

MLA_MODEL_TYPES: tuple[str, ...] = ("deepseek_v2", "deepseek_v3", "kimi_linear", "kvzoo_mla")
KIMI_MIN_TRANSFORMERS = (5, 18)


def _version_tuple(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def check_transformers_for(model_type: str, version: str = transformers.__version__) -> None:
    """Raise if this transformers is too old for ``model_type`` (Kimi Linear needs >= 5.18)."""
    if model_type == "kimi_linear" and _version_tuple(version) < KIMI_MIN_TRANSFORMERS:
        need = ".".join(map(str, KIMI_MIN_TRANSFORMERS))
        raise RuntimeError(
            f"Kimi Linear needs transformers >= {need} (native KimiLinear classes); this environment has "
            f"{version}. Upgrade with: pip install 'transformers>={need}'"
        )


def _rotate_deepseek_v2(module: torch.nn.Module, q_r, r, position_embeddings):
    rotate = sys.modules[type(module).__module__].apply_rotary_emb  # interleaved pairs (complex form)
    return rotate(q_r, r, position_embeddings)


def _rotate_deepseek_v3(module: torch.nn.Module, q_r, r, position_embeddings):
    modeling = sys.modules[type(module).__module__]
    cos, sin = position_embeddings
    if module.config.rope_interleave:
        return modeling.apply_rotary_pos_emb_interleave(q_r, r, cos, sin)
    return modeling.apply_rotary_pos_emb(q_r, r, cos, sin)


def _no_rotation(module: torch.nn.Module, q_r, r, position_embeddings):
    return q_r, r


def _rotate_kvzoo_mla(module: torch.nn.Module, q_r, r, position_embeddings):
    # kvzoo's reference twins: RoPE arm when config.rope_branch, NoPE (identity) otherwise
    from kvzoo.refmodel.modeling import rotate_branch

    return rotate_branch(module, q_r, r, position_embeddings)


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


ROTATIONS = {
    "deepseek_v2": _rotate_deepseek_v2,
    "deepseek_v3": _rotate_deepseek_v3,
    "kimi_linear": _no_rotation,
    "kvzoo_mla": _rotate_kvzoo_mla,
}


class MLAAdapter:
    layout = "mla"

    def __init__(self, model: torch.nn.Module) -> None:
        config = model.config.get_text_config(decoder=True)
        self.model_type = config.model_type
        check_transformers_for(self.model_type)
        self.num_layers = config.num_hidden_layers
        layer_types = getattr(config, "layer_types", None) or ["full_attention"] * self.num_layers
        self.mla_layers = [i for i, t in enumerate(layer_types) if t == "full_attention"]
        self.kv_lora_rank = config.kv_lora_rank
        self.rope_dim = config.qk_rope_head_dim
        self.decompress_min_queries = decompress_break_even(
            config.kv_lora_rank, config.qk_rope_head_dim, config.qk_nope_head_dim, config.v_head_dim
        )
        self.row_dim = self.kv_lora_rank + self.rope_dim
        self.num_heads = config.num_attention_heads
        # DeepSeek rotates the branch; Kimi never does; kvzoo's reference models say so in their config
        self.rotates_branch = self.model_type != "kimi_linear" and getattr(config, "rope_branch", True)
        self.modules = {}
        for module in model.modules():
            idx = getattr(module, "layer_idx", None)
            if idx in self.mla_layers and hasattr(module, "kv_b_proj") and hasattr(module, "kv_a_proj_with_mqa"):
                self.modules[idx] = module
        missing = sorted(set(self.mla_layers) - set(self.modules))
        if missing:
            raise ValueError(f"{type(model).__name__}: no MLA attention module found for layers {missing}")

    def is_tiered(self, layer_idx: int) -> bool:
        return layer_idx in self.modules

    def attach(self) -> None:
        for module in self.modules.values():
            if getattr(module, "_kvzoo_original_forward", None) is None:
                module._kvzoo_original_forward = module.forward
                module._kvzoo_rotate = ROTATIONS[self.model_type]
                module.forward = _mla_forward.__get__(module)



def absorbed_weights(module: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """``W_UK [H, nope, kv_lora_rank]`` and ``W_UV [H, v, kv_lora_rank]`` from ``kv_b_proj``."""
    H, nope, v = module.num_heads, module.qk_nope_head_dim, module.v_head_dim
    weight = module.kv_b_proj.weight.view(H, nope + v, module.kv_lora_rank)
    return weight[:, :nope], weight[:, nope:]


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
    cache.update(row, None, self.layer_idx)
    query = MLAQuery(q_nope, q_r, self.kv_b_proj.weight, self.v_head_dim, self.scaling)
    out = mla_attention(layer.runtime, layer.state, query, attention_mask, layer.decompress_min_queries)  # [B, H, q, v]
    return self.o_proj(out.transpose(1, 2).reshape(B, q_len, -1)), None
