"""GQA/MHA adapter (Llama, Qwen2/3, Mistral, SmolLM2): rows are one KV head's key and value.

transformers' own attention modules project and rotate; kvzoo receives the rotated keys through
``Cache.update`` and computes attention in ``framework/attention.py``. Keys stay rotated at their
original positions; decoding continues at the true length because ``TieredCache`` reports it.
"""

from __future__ import annotations

import torch

GQA_MODEL_TYPES: tuple[str, ...] = ("llama", "qwen2", "qwen3", "mistral")


class GQAAdapter:
    layout = "gqa"

    def __init__(self, model: torch.nn.Module) -> None:
        config = model.config.get_text_config(decoder=True)
        self.num_layers = config.num_hidden_layers
        layer_types = getattr(config, "layer_types", None) or ["full_attention"] * self.num_layers
        sliding = [i for i, t in enumerate(layer_types) if t != "full_attention"]
        uses_sliding = getattr(config, "use_sliding_window", True) and getattr(config, "sliding_window", None)
        if sliding or uses_sliding:
            raise ValueError(
                f"{type(model).__name__} has sliding-window attention (layers {sliding or 'all'}); kvzoo's GQA "
                "adapter supports full-attention layers only (set sliding_window=None or use_sliding_window=False)"
            )
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads

    def is_tiered(self, layer_idx: int) -> bool:
        return True

    def attach(self) -> None:
        """Nothing to replace: transformers' attention modules call kvzoo's registered attention."""
