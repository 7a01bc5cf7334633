"""kvzoo policies as kvpress presses (imports kvpress; use :func:`kvzoo.integrations.kvpress.to_press`).

A press builds, from what kvpress's hook hands it, the :class:`RowsView` a kvzoo selector reads: one row per token
and, when asked, the observation window's attention recomputed as kvpress's ``SnapKVPress`` does, or H2O's
accumulated attention. Quest keeps the pages its bound ranks highest for the last query (:func:`quest_priority`).
"""

from __future__ import annotations

import importlib
import math
import warnings
from collections.abc import Callable
from typing import Any

import torch
from kvpress import BasePress, ScorerPress
from kvpress.utils import compute_n_kept, get_prerope_query_states
from torch import nn
from transformers.models.llama.modeling_llama import rotate_half  # what kvpress's SnapKVPress rotates with

from kvzoo import registry
from kvzoo.framework.policy import (
    AttentionInputs,
    Observation,
    Policy,
    RowsView,
    WindowQueries,
    observed_rows,
    top_rows,
)
from kvzoo.framework.retriever import RowGeometry
from kvzoo.kernels.attention import attention_reference


def recomputed_queries(module: nn.Module, hidden_states: torch.Tensor, kwargs: dict, last: int | None = None) -> torch.Tensor:
    """The attention's rotated queries ``[B, H, q, dh]`` of the ``last`` tokens (None: all), from its input."""
    if last is not None:
        hidden_states = hidden_states[:, -last:]
    query = get_prerope_query_states(module, hidden_states)  # [B, H, q, dh], q-norm applied where the model has one
    cos, sin = kwargs["position_embeddings"]  # [B, T, dh]
    q_len = query.shape[2]
    cos, sin = cos[:, -q_len:, None].transpose(1, 2), sin[:, -q_len:, None].transpose(1, 2)
    return query * cos + rotate_half(query) * sin


def queries_available(hidden_states: torch.Tensor, kwargs: dict, n: int) -> int:
    """How many of the latest queries a call can recompute: those whose input (``hidden_states``) and RoPE
    (``position_embeddings``) the forward hands over, at most the layer's ``n`` rows."""
    cos, _ = kwargs["position_embeddings"]
    return max(1, min(hidden_states.shape[1], cos.shape[1], n))


def quest_priority(policy: Policy, rows: RowsView, keep: int) -> torch.Tensor:
    """Quest at the context's end, as a score ``[B, G, n]`` (fp32): the rows its retriever would read first.

    Laid out as kvzoo's runtime lays the rows out then (sinks, archived pages, the current page), an archived row
    scores its page's bound for the context's last query (max over the KV head's query heads); the sinks and the current
    page score ``+inf`` (when ``keep`` cannot hold them all, the first sinks and the latest rows do).
    """
    inputs = rows.inputs
    module = inputs.module
    B, G, n, _ = rows.keys.shape
    size = policy.page_size
    current = (n - 1) % size + 1
    sinks = min(policy.sinks, n - current)
    archived = slice(sinks, n - current)
    priority = torch.full((B, G, n), math.inf, dtype=torch.float32, device=rows.keys.device)
    if n - current > sinks:
        kwargs = {"position_embeddings": inputs.position_embeddings}
        query = recomputed_queries(module, inputs.hidden_states, kwargs, last=1)  # [B, H, 1, dh]
        index = registry.build_retriever("quest", page_size=size, gqa="group").new_state(RowGeometry("gqa", 0))
        index.index({"keys": rows.keys[:, :, archived], "valid": rows.valid[:, :, archived]}, None, None)
        bounds = index.bounds(query, getattr(module, "scaling", module.head_dim ** -0.5))  # [B, H, 1, pages]
        H = bounds.shape[1]
        page_bounds = bounds.view(B, G, H // G, -1).amax(dim=2).float()  # [B, G, pages]
        page_of_row = torch.arange(n - current - sinks, device=rows.keys.device) // size
        priority[:, :, archived] = page_bounds[:, :, page_of_row]
    if keep >= sinks + current:
        return priority
    special = torch.zeros(n, dtype=torch.bool, device=rows.keys.device)
    special[:sinks] = True
    special[n - current:] = True
    first = min(sinks, keep)
    forced = torch.zeros_like(special)
    forced[:first] = True
    if keep > first:
        forced[n - (keep - first):] = True
    pages = priority[:, :, ~special]
    top = pages.max() if pages.numel() else priority.new_zeros(())
    return torch.where(forced, priority, torch.where(special, top + 1, priority))


def press_rule(policy: Policy) -> Callable[[Policy, RowsView, int], torch.Tensor] | None:
    """The policy's press rule, ``(policy, rows, keep) -> priority [B, G, n]``, for a selector whose press form is not
    its runtime selector: the function its class names as ``press_rule = "package.module:function"`` (``quest``:
    :func:`quest_priority`), or None."""
    spec = getattr(type(policy), "press_rule", None)
    if spec is None:
        return None
    module, _, function = spec.partition(":")
    return getattr(importlib.import_module(module), function)


class KvzooPress(BasePress):
    """A kvzoo policy run by kvpress: at the end of the prefill each layer keeps what ``policy.select`` chooses
    (for a policy with a :func:`press_rule`, ``quest``: the top rows of that rule).

    ``compression_ratio`` (kvpress's, the fraction removed) at ``1 - 1/policy.ratio`` keeps exactly kvzoo's count;
    any other value (the caller's, or a kvpress wrapper's) keeps kvpress's ``max(1, int(n * (1 - c)))`` (0 at c = 1).
    """

    def __init__(self, policy: Policy, compression_ratio: float | None = None, *,
                 exact_compression_ratio: float | None = None) -> None:
        self.policy = policy
        self.exact_compression_ratio = exact_compression_ratio  # 1 - 1/ratio (to_press computes it)
        self.compression_ratio = self.exact_compression_ratio if compression_ratio is None else compression_ratio
        self.press_rule = press_rule(policy)
        # the policy's cross-layer scratch for one prefill (ChunkKV's reuse), one per call of a layer: a wrapper that
        # scores a layer in parts (ChunkPress) calls each layer once per part, and part i reuses part i's scratch
        self._shared: dict[int, dict[str, Any]] = {}
        self._last_layer = -1
        self._part = 0
        self._said: set[str] = set()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(policy={self.policy!r}, compression_ratio={self.compression_ratio!r})"

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and (self.policy, self.compression_ratio) == (other.policy, other.compression_ratio)

    __hash__ = None  # type: ignore[assignment]

    # --- how many rows stay --------------------------------------------------------------------------------
    def kept_rows(self, n: int) -> int:
        """Rows a layer of ``n`` keeps (see the class docstring)."""
        if self.compression_ratio != self.exact_compression_ratio:
            return min(n, compute_n_kept(n, self.compression_ratio))
        budget = self.policy.resolve_budget(n)
        if self.press_rule is not None:
            return n if budget is None else min(n, budget)
        target = self.policy.target_rows("context_end", budget=budget, resident=n, block_rows=n, seen=n)
        return n if target is None else target

    def _say_once(self, what: str, message: str) -> None:
        if what not in self._said:
            self._said.add(what)
            warnings.warn(message, UserWarning, stacklevel=4)

    def _window(self, n: int, keep: int, available: int) -> int:
        """The observation window's queries for a call (see the module docstring), said once when shrunk."""
        window = self.policy.observation_window
        w = min(window, n, max(1, keep), available)
        if w < window:
            why = (f"the layer holds {n} rows" if w == n else
                   f"kvpress hands over the input and RoPE of {available} tokens" if w == available else
                   f"it may keep {keep} rows and the window is always kept")
            self._say_once("window", (
                f"{self.policy.name} as a kvpress press: an observation window of {w} quer{'y' if w == 1 else 'ies'} "
                "instead of "
                f"window={window} ({why}); said once per press. kvzoo's own runtime refuses a budget below the "
                "window (ValueError)"))
        return w

    # --- the rows a kvzoo selector reads -----------------------------------------------------------------------
    def rows(self, module: nn.Module, hidden_states: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
             kwargs: dict, keep: int) -> RowsView:
        """The layer's rows as the selector sees them in kvzoo's runtime after an unpadded prefill."""
        B, G, n, _ = keys.shape
        layer = module.layer_idx
        if layer < self._last_layer or (layer == self._last_layer and module.config.num_hidden_layers == 1):
            self._shared, self._part = {}, 0  # a new prefill (or compression event): the scratch starts over
        elif layer == self._last_layer:
            self._part += 1  # the same layer again: its next part
        else:
            self._part = 0
        self._last_layer = layer
        slots = torch.arange(n, device=keys.device).expand(B, G, n)
        valid = torch.ones(B, G, n, dtype=torch.bool, device=keys.device)
        scaling = getattr(module, "scaling", module.head_dim ** -0.5)
        policy = self.policy
        available = queries_available(hidden_states, kwargs, n)
        window = None
        if Observation.WINDOW in policy.observes and policy.observation_window > 0:
            w = self._window(n, keep, available)
            window = WindowQueries(w, n, scaling, lambda: recomputed_queries(module, hidden_states, kwargs, last=w))
        row_stats: dict[str, torch.Tensor] = {}
        if Observation.ACCUMULATE in policy.observes:  # H2O: the attention every row received from the call's queries
            queries = recomputed_queries(module, hidden_states, kwargs, last=available)
            _, sums = attention_reference(queries, keys, values, slots, valid,
                                          torch.arange(n - available, n, device=keys.device), scaling, column_sums=True)
            row_stats["attention"] = sums
        return observed_rows(
            policy, keys, values, slots, valid, window=window, layer_idx=layer,
            num_layers=module.config.num_hidden_layers, layout="gqa", layer_rank=layer, row_stats=row_stats,
            shared=self._shared.setdefault(self._part, {}),
            inputs=AttentionInputs(module, hidden_states, kwargs["position_embeddings"]),
        )

    def select(self, rows: RowsView, keep: int) -> torch.Tensor:
        """Sorted indices ``[B, G, keep]``: the policy's selector, or the top rows of its press rule."""
        if self.press_rule is not None:
            return top_rows(self.press_rule(self.policy, rows, keep), keep)
        return self.policy.select(rows, keep)

    def priority(self, rows: RowsView, keep: int) -> torch.Tensor | None:
        """The selector as a score (fp32 ``[B, G, n]``, forced rows ``+inf``), or None for a selector that is none."""
        if self.press_rule is not None:
            return self.press_rule(self.policy, rows, keep)
        return self.policy.priority(rows, keep)

    def compress(self, module: nn.Module, hidden_states: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                 attentions: torch.Tensor, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor]:
        n = keys.shape[2]
        keep = self.kept_rows(n)
        if self.compression_ratio == 0 or keep >= n or module.layer_idx < self.policy.dense_layers:
            return keys, values
        if keep == 0:  # compression_ratio 1 (PerLayerCompressionPress may ask it): the layer keeps nothing
            return keys[:, :, :0].contiguous(), values[:, :, :0].contiguous()
        kept = self.select(self.rows(module, hidden_states, keys, values, kwargs, keep), keep)  # [B, G, keep] sorted
        keys = keys.gather(2, kept[..., None].expand(-1, -1, -1, keys.shape[-1])).contiguous()
        values = values.gather(2, kept[..., None].expand(-1, -1, -1, values.shape[-1])).contiguous()
        return keys, values


class KvzooScorerPress(KvzooPress, ScorerPress):
    """A score-based kvzoo selector as a kvpress ``ScorerPress``: ``score()`` is the selector as a score, so kvpress's
    wrappers that take their own top-k compose. Alone it keeps exactly what the selector keeps (ties to the earlier
    row); rows a selector always keeps score one above the best other row, as kvpress pads its windows."""

    def score(self, module: nn.Module, hidden_states: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
              attentions: torch.Tensor, kwargs: dict) -> torch.Tensor:
        n = keys.shape[2]
        keep = max(1, min(n, self.kept_rows(n)))  # a wrapper may ask 0 rows (ratio 1): rank as if one stayed
        priority = self.priority(self.rows(module, hidden_states, keys, values, kwargs, keep), keep)  # forced: +inf
        forced = priority == torch.inf
        others = priority[~forced]
        top = others.max() if others.numel() else priority.new_zeros(())
        return torch.where(forced, top + 1, priority)
