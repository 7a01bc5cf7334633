"""GQA/MHA adapter (Llama, Qwen2/3, Mistral, SmolLM2): rows are one KV head's key and value.

transformers' own attention modules project and rotate; kvzoo receives the rotated keys through
``Cache.update`` and computes attention in ``framework/attention.py``. Keys stay rotated at their
original positions; decoding continues at the true length because ``TieredCache`` reports it.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from kvzoo.framework.adapters.base import Geometry
from kvzoo.framework.policy import Policy

GQA_MODEL_TYPES: tuple[str, ...] = ("llama", "qwen2", "qwen3", "mistral")


# attention modules that already carry the "inputs" recorder (one hook per module, whatever the number of caches)
_RECORDING: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()


def _record_inputs(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Forward pre-hook: hand the attention's input hidden states and RoPE to the TieredCache it is given."""
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    layer = cache.kvzoo_layer(module.layer_idx) if hasattr(cache, "kvzoo_layer") else None
    if layer is None:
        return
    hidden_states = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
    layer.runtime.record_inputs(layer, module, hidden_states, kwargs.get("position_embeddings"))


class GQAAdapter:
    """Every layer tiered; a row is one KV head's rotated key and value."""

    name = "gqa"
    model_types = GQA_MODEL_TYPES
    layout = "gqa"

    def __init__(self, model: torch.nn.Module, policy: Policy) -> None:
        config = model.config.get_text_config(decoder=True)
        num_layers = config.num_hidden_layers
        layer_types = getattr(config, "layer_types", None) or ["full_attention"] * num_layers
        sliding = [i for i, t in enumerate(layer_types) if t != "full_attention"]
        uses_sliding = getattr(config, "use_sliding_window", True) and getattr(config, "sliding_window", None)
        if sliding or uses_sliding:
            raise ValueError(
                f"{type(model).__name__} has sliding-window attention (layers {sliding or 'all'}); kvzoo's GQA "
                "adapter supports full-attention layers only (set sliding_window=None or use_sliding_window=False)"
            )
        self.geometry = Geometry("gqa", num_layers, tuple(range(num_layers)), config.num_attention_heads,
                                 config.num_key_value_heads)
        self._modules: dict[int, weakref.ref[torch.nn.Module]] = {}
        for module in model.modules():
            idx = getattr(module, "layer_idx", None)
            if isinstance(idx, int) and hasattr(module, "q_proj") and idx not in self._modules:
                self._modules[idx] = weakref.ref(module)
        # a policy observing "inputs" (a kvpress press) reads each attention module's input: the modules to hook
        self._recorded = [weakref.ref(m) for m in model.modules() if hasattr(m, "q_proj") and hasattr(m, "layer_idx")] \
            if "inputs" in policy.observes else []

    def attention_modules(self) -> dict[int, torch.nn.Module]:
        """The modules with a ``q_proj`` and a ``layer_idx`` (the first of each index)."""
        return {i: m for i, ref in self._modules.items() if (m := ref()) is not None}

    def untiered_layer(self, layer_idx: int) -> Any:
        raise ValueError(f"every layer of a GQA model is tiered (layer {layer_idx} asked for)")

    def attach(self) -> None:
        """transformers' attention modules call kvzoo's registered attention; nothing to replace. For a policy
        observing "inputs", a forward pre-hook on each attention module records its input hidden states and RoPE
        into the TieredCache it is handed (installed once per module; it does nothing for other caches)."""
        for ref in self._recorded:
            module = ref()
            if module is not None and module not in _RECORDING:
                module.register_forward_pre_hook(_record_inputs, with_kwargs=True)
                _RECORDING.add(module)
