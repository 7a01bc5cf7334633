"""GQA/MHA adapter (Llama, Qwen2/3, Mistral, SmolLM2, Gemma 3): rows are one KV head's key and value.

transformers' own attention modules project and rotate; kvzoo receives the rotated keys through
``Cache.update`` and computes attention in ``framework/attention.py``. Keys stay rotated at their
original positions; decoding continues at the true length because ``TieredCache`` reports it.

**Hybrid models** (Gemma 2/3: most layers attend over a sliding window, a few globally; ``config.layer_types``
says which): the policy acts on the global layers only; each sliding-window layer keeps transformers' own
:class:`~transformers.cache_utils.DynamicSlidingWindowLayer` (its last ``sliding_window - 1`` rows), attended
through the same registered attention with the window applied (:func:`kvzoo.framework.attention.kvzoo_attention`).
The cache's statistics count those layers apart (``CacheStats.untiered``), so a ratio is never stated over the
global layers alone.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from kvzoo.framework.adapters.base import Geometry
from kvzoo.framework.policy import Observation, Policy

GQA_MODEL_TYPES: tuple[str, ...] = ("llama", "qwen2", "qwen3", "mistral", "gemma3_text")


# attention modules that already carry the "inputs" recorder (one hook per module, whatever the number of caches)
_RECORDING: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()


def _record_inputs(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Forward pre-hook: hand the attention's input hidden states and RoPE to the TieredCache it is given."""
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    layer = cache.kvzoo_layer(module.layer_idx) if hasattr(cache, "kvzoo_layer") else None
    if layer is None:
        return
    # kept from the layer's last event until the next, and only until the context ends (a policy that runs the model's
    # own code on the layer -- a kvpress press -- compresses the context once)
    if Observation.INPUTS not in layer.runtime.policy.observes or layer.context_ended:
        return
    hidden_states = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
    layer.observed.record_inputs(module, hidden_states, kwargs.get("position_embeddings"))


class GQAAdapter:
    """The global (full-attention) layers tiered; a row is one KV head's rotated key and value. Sliding-window
    layers of a hybrid model keep transformers' sliding-window cache layer."""

    name = "gqa"
    model_types = GQA_MODEL_TYPES
    layout = "gqa"

    def __init__(self, model: torch.nn.Module, policy: Policy) -> None:
        config = model.config.get_text_config(decoder=True)
        num_layers = config.num_hidden_layers
        window = getattr(config, "sliding_window", None)
        layer_types = getattr(config, "layer_types", None)
        if layer_types is None:  # no per-layer types: every layer slides when the config says so (Mistral)
            slides = bool(getattr(config, "use_sliding_window", True) and window)
            layer_types = ["sliding_attention" if slides else "full_attention"] * num_layers
        unknown = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
        if unknown:
            raise ValueError(f"{type(model).__name__} has layer types {unknown}; kvzoo's GQA adapter supports "
                             "'full_attention' (tiered) and 'sliding_attention' (kept in a sliding-window layer)")
        tiered = tuple(i for i, t in enumerate(layer_types) if t == "full_attention")
        if not tiered:
            raise ValueError(
                f"{type(model).__name__} attends over a sliding window in every layer: there is no global layer "
                "for a policy to act on (kvzoo's GQA adapter tiers the full-attention layers; set "
                "use_sliding_window=False or sliding_window=None to attend globally)"
            )
        if len(tiered) < num_layers and not isinstance(window, int):
            raise ValueError(f"{type(model).__name__} has sliding-attention layers but no integer sliding_window "
                             f"(got {window!r})")
        self.sliding_window = window if len(tiered) < num_layers else None
        self.geometry = Geometry("gqa", num_layers, tiered, config.num_attention_heads, config.num_key_value_heads)
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
        """A sliding-window layer's own cache layer (transformers'), holding its last ``sliding_window - 1`` rows."""
        if self.sliding_window is None or layer_idx in self.geometry.tiered:
            raise ValueError(f"layer {layer_idx} is a global layer: it is tiered")
        from transformers.cache_utils import DynamicSlidingWindowLayer

        return DynamicSlidingWindowLayer(sliding_window=self.sliding_window)

    def attach(self) -> None:
        """transformers' attention modules call kvzoo's registered attention; nothing to replace. For a policy
        observing "inputs", a forward pre-hook on each attention module records its input hidden states and RoPE
        into the TieredCache it is handed (installed once per module; it does nothing for other caches)."""
        for ref in self._recorded:
            module = ref()
            if module is not None and module not in _RECORDING:
                module.register_forward_pre_hook(_record_inputs, with_kwargs=True)
                _RECORDING.add(module)
