"""A tiny Kimi-style MLA model (model_type ``kvzoo_mla``), kvzoo's stand-in for a trained Kimi Linear.

A block is ``x += ShortConv(norm x)`` (kernel 4, in KDA's role), ``x += MLA(norm x)`` (DeepSeek-V2's module layout
and names, so kvzoo's MLA adapter takes it over) and ``x += SwiGLU(norm x)``; ``config.rope_branch`` is the one
difference between the arms, NoPE (Kimi) or RoPE (DeepSeek). The conv's last inputs per layer live on the cache
(``cache.kvzoo_conv_state``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache
from transformers.masking_utils import create_causal_mask
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import rotate_half

CONV_STATE_ATTR = "kvzoo_conv_state"


class KvzooMLAConfig(PretrainedConfig):
    """Config of :class:`KvzooMLAForCausalLM`; MLA field names as in DeepSeek-V2 / Kimi Linear. ``rope_branch``: False =
    NoPE arm (Kimi), True = RoPE arm (DeepSeek); the defaults are the measured recipe (docs/environment.md)."""

    model_type = "kvzoo_mla"

    def __init__(
        self,
        vocab_size: int = 256,
        hidden_size: int = 128,
        intermediate_size: int = 256,
        num_hidden_layers: int = 2,
        num_attention_heads: int = 4,
        kv_lora_rank: int = 128,
        q_lora_rank: int | None = None,
        qk_rope_head_dim: int = 16,
        qk_nope_head_dim: int = 32,
        v_head_dim: int = 32,
        conv_kernel_size: int = 4,
        rope_branch: bool = False,
        rope_theta: float = 10000.0,
        max_position_embeddings: int = 4096,
        rms_norm_eps: float = 1e-6,
        initializer_range: float = 0.02,
        pad_token_id: int = 0,
        bos_token_id: int = 1,
        eos_token_id: int | None = None,
        tie_word_embeddings: bool = False,
        **kwargs: Any,
    ) -> None:
        if q_lora_rank is not None:
            raise ValueError("KvzooMLAConfig: q_lora_rank must be None (q_proj only, as in DeepSeek-V2-Lite)")
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_attention_heads
        self.kv_lora_rank = kv_lora_rank
        self.q_lora_rank = q_lora_rank
        self.qk_rope_head_dim = qk_rope_head_dim
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        self.head_dim = qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.conv_kernel_size = conv_kernel_size
        self.rope_branch = bool(rope_branch)
        self.rope_theta = rope_theta
        self.max_position_embeddings = max_position_embeddings
        self.rms_norm_eps = rms_norm_eps
        self.initializer_range = initializer_range
        self.attention_dropout = 0.0
        self.layer_types = ["full_attention"] * num_hidden_layers
        super().__init__(
            pad_token_id=pad_token_id, bos_token_id=bos_token_id, eos_token_id=eos_token_id,
            tie_word_embeddings=tie_word_embeddings, **kwargs,
        )


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class RotaryEmbedding(nn.Module):
    """Standard (half-split) RoPE over the ``qk_rope_head_dim`` branch dims; returns ``(cos, sin)``.

    The frequencies are computed from the config at every call, never stored: a non-persistent
    buffer is not in the checkpoint, and ``from_pretrained`` (which builds modules on the meta
    device) left it uninitialised, so each load rotated with different garbage frequencies.
    """

    def __init__(self, config: KvzooMLAConfig) -> None:
        super().__init__()
        self.dim = config.qk_rope_head_dim
        self.theta = config.rope_theta

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        exponents = torch.arange(0, self.dim, 2, dtype=torch.float32, device=device) / self.dim
        return 1.0 / (self.theta**exponents)

    @torch.no_grad()
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[:, :, None].float() * self.inv_freq(x.device)[None, None, :]  # [B, T, dim/2]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def apply_rotary_pos_emb(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Rotate ``q [B, H, T, r]`` and ``k [B, 1, T, r]`` with ``cos/sin [B, T, r]``."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    q_out = q * cos.to(q.dtype) + rotate_half(q) * sin.to(q.dtype)
    k_out = k * cos.to(k.dtype) + rotate_half(k) * sin.to(k.dtype)
    return q_out, k_out


def rotate_branch(module: nn.Module, q_r: torch.Tensor, r: torch.Tensor, position_embeddings: Any):
    """The arm's branch rotation: RoPE when ``config.rope_branch``, identity (NoPE) otherwise."""
    if not module.config.rope_branch:
        return q_r, r
    cos, sin = position_embeddings
    return apply_rotary_pos_emb(q_r, r, cos, sin)


def eager_attention_forward(
    module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    attention_mask: torch.Tensor | None, scaling: float, dropout: float = 0.0, **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling  # [B, H, q, n]
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attention_mask, torch.finfo(scores.dtype).min)
        else:
            scores = scores + attention_mask[..., : key.shape[-2]]
    weights = F.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    out = torch.matmul(weights, value).transpose(1, 2).contiguous()  # [B, q, H, v]
    return out, weights


class ShortConv(nn.Module):
    """Depthwise causal conv (kernel ``k``) + SiLU + output projection; carries ``k-1`` inputs across calls."""

    def __init__(self, config: KvzooMLAConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.kernel = config.conv_kernel_size
        self.conv = nn.Conv1d(config.hidden_size, config.hidden_size, self.kernel, groups=config.hidden_size)
        self.out_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cache: Cache | None = None) -> torch.Tensor:
        B, T, d = x.shape
        tails = getattr(cache, CONV_STATE_ATTR, None) if cache is not None else None
        prev = tails.get(self.layer_idx) if tails is not None else None
        if prev is None or prev.shape[0] != B:
            prev = x.new_zeros(B, self.kernel - 1, d)
        extended = torch.cat([prev.to(x.dtype), x], dim=1)  # [B, k-1+T, d]
        if tails is not None:
            tails[self.layer_idx] = extended[:, -(self.kernel - 1):].detach()
        y = self.conv(extended.transpose(1, 2)).transpose(1, 2)  # [B, T, d]
        return self.out_proj(F.silu(y))


class KvzooMLAAttention(nn.Module):
    """MLA with DeepSeek-V2's module layout (no q-LoRA); the branch is rotated only in the RoPE arm."""

    def __init__(self, config: KvzooMLAConfig, layer_idx: int) -> None:
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_key_value_groups = 1
        self.q_lora_rank = None
        self.qk_rope_head_dim = config.qk_rope_head_dim
        self.qk_nope_head_dim = config.qk_nope_head_dim
        self.qk_head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
        self.v_head_dim = config.v_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        self.is_causal = True
        self.attention_dropout = 0.0
        d = config.hidden_size
        self.q_proj = nn.Linear(d, self.num_heads * self.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(d, self.kv_lora_rank + self.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, eps=config.rms_norm_eps)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, self.num_heads * (self.qk_nope_head_dim + self.v_head_dim), bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.v_head_dim, d, bias=False)
        self.scaling = self.qk_head_dim**-0.5

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        B, T = hidden_states.shape[:2]
        q = self.q_proj(hidden_states).view(B, T, self.num_heads, self.qk_head_dim).transpose(1, 2)
        q_nope, q_r = torch.split(q, [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        c, r = torch.split(self.kv_a_proj_with_mqa(hidden_states), [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        kv_nope = self.kv_a_layernorm(c).view(B, 1, T, self.kv_lora_rank)  # latent c
        k_rot = r.view(B, 1, T, self.qk_rope_head_dim)  # branch r
        q_r, k_rot = rotate_branch(self, q_r, k_rot, position_embeddings)
        if cache is not None:
            kv_nope, k_rot = cache.update(kv_nope, k_rot, self.layer_idx)
        n = kv_nope.shape[2]
        kv = self.kv_b_proj(kv_nope).view(B, n, self.num_heads, self.qk_nope_head_dim + self.v_head_dim).transpose(1, 2)
        k_nope, value = torch.split(kv, [self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        key = torch.cat([k_nope, k_rot.to(k_nope.dtype).expand(-1, self.num_heads, -1, -1)], dim=-1)
        query = torch.cat([q_nope, q_r], dim=-1)
        attention: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        out, weights = attention(self, query, key, value, attention_mask, dropout=0.0, scaling=self.scaling, **kwargs)
        return self.o_proj(out.reshape(B, T, -1)), weights


class SwiGLU(nn.Module):
    def __init__(self, config: KvzooMLAConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class KvzooMLADecoderLayer(nn.Module):
    def __init__(self, config: KvzooMLAConfig, layer_idx: int) -> None:
        super().__init__()
        self.conv_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.short_conv = ShortConv(config, layer_idx)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = KvzooMLAAttention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SwiGLU(config)

    def forward(
        self, hidden_states: torch.Tensor, attention_mask: Any, cache: Cache | None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor], **kwargs: Any,
    ) -> torch.Tensor:
        hidden_states = hidden_states + self.short_conv(self.conv_norm(hidden_states), cache)
        attn_out, _ = self.self_attn(
            self.input_layernorm(hidden_states), attention_mask=attention_mask, cache=cache,
            position_embeddings=position_embeddings, **kwargs,
        )
        hidden_states = hidden_states + attn_out
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class KvzooMLAPreTrainedModel(PreTrainedModel):
    config_class = KvzooMLAConfig
    config: KvzooMLAConfig
    base_model_prefix = "model"
    _no_split_modules = ["KvzooMLADecoderLayer"]
    _supports_sdpa = True
    _supports_attention_backend = True

    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, nn.Conv1d):
            nn.init.normal_(module.weight, mean=0.0, std=0.3)
            nn.init.zeros_(module.bias)
        elif isinstance(module, RMSNorm):
            nn.init.ones_(module.weight)


class KvzooMLAModel(KvzooMLAPreTrainedModel):
    def __init__(self, config: KvzooMLAConfig) -> None:
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([KvzooMLADecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)
        self.post_init()

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        past_key_values: Cache | None = None,
        **kwargs: Any,
    ) -> BaseModelOutputWithPast:
        cache = cache if cache is not None else past_key_values
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        past = cache.get_seq_length() if cache is not None else 0
        if cache is not None and (past == 0 or getattr(cache, CONV_STATE_ATTR, None) is None):
            setattr(cache, CONV_STATE_ATTR, {})  # a fresh sequence: no conv tails yet
        if position_ids is None:
            position_ids = (torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past).unsqueeze(0)
        mask = create_causal_mask(
            config=self.config, inputs_embeds=inputs_embeds, attention_mask=attention_mask,
            cache=cache, position_ids=position_ids,
        )
        position_embeddings = self.rotary_emb(inputs_embeds, position_ids)
        hidden = inputs_embeds
        for layer in self.layers:
            hidden = layer(hidden, mask, cache, position_embeddings, **kwargs)
        return BaseModelOutputWithPast(last_hidden_state=self.norm(hidden), cache=cache)


class KvzooMLAForCausalLM(KvzooMLAPreTrainedModel, GenerationMixin):
    def __init__(self, config: KvzooMLAConfig) -> None:
        super().__init__(config)
        self.model = KvzooMLAModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int = 0,
        past_key_values: Cache | None = None,
        **kwargs: Any,
    ) -> CausalLMOutputWithPast:
        out = self.model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
            cache=cache if cache is not None else past_key_values, inputs_embeds=inputs_embeds,
            use_cache=use_cache, **kwargs,
        )
        hidden = out.last_hidden_state
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        logits = self.lm_head(hidden)
        loss = None
        if labels is not None:  # labels aligned with input_ids; -100 = ignored
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits, cache=out.cache)
