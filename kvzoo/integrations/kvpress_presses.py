"""kvzoo policies as kvpress presses: the press classes (imports kvpress; use :func:`kvzoo.integrations.kvpress.to_press`).

A press gets what kvpress's hook hands every press -- the attention module, its input hidden states,
the layer's keys and values, the forward's keyword arguments -- and builds the :class:`RowsView` a
kvzoo selector reads: the keys and values as rows, one slot per token (kvpress compresses one
unpadded prefill, so the slots are ``0 .. n-1`` and every row is valid), and, when the selector asks
for them, the observation window's attention (the last ``w`` queries recomputed from the hidden
states and rotated with the forward's RoPE, as kvpress's ``SnapKVPress.compute_window_attention``
recomputes them, then softmaxed by kvzoo's own kernel) or H2O's accumulated attention (every
query of the prefill, recomputed the same way, column-summed by kvzoo's reference attention).
"""

from __future__ import annotations

from typing import Any

import torch
from kvpress import BasePress, ScorerPress
from kvpress.utils import compute_n_kept, get_prerope_query_states
from torch import nn

from kvzoo.framework.policy import Policy, RowsView
from kvzoo.kernels.attention import attention_reference, window_attention


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def recomputed_queries(module: nn.Module, hidden_states: torch.Tensor, kwargs: dict, last: int | None = None) -> torch.Tensor:
    """The attention's rotated queries ``[B, H, q, dh]`` of the ``last`` tokens (None: all), from its input."""
    if last is not None:
        hidden_states = hidden_states[:, -last:]
    query = get_prerope_query_states(module, hidden_states)  # [B, H, q, dh], q-norm applied where the model has one
    cos, sin = kwargs["position_embeddings"]  # [B, T, dh]
    q_len = query.shape[2]
    cos, sin = cos[:, -q_len:, None].transpose(1, 2), sin[:, -q_len:, None].transpose(1, 2)
    return query * cos + _rotate_half(query) * sin


class KvzooPress(BasePress):
    """A kvzoo policy run by kvpress: at the end of the prefill each layer keeps what ``policy.select`` chooses.

    ``compression_ratio`` is kvpress's (the fraction removed). Given the policy's ``ratio`` r it is
    ``1 - 1/r``, and then the press keeps exactly what kvzoo's runtime keeps at the context's end
    (``policy.target_rows`` of ``max(1, floor(n / r))`` rows); set to any other value -- by the caller,
    or by a kvpress wrapper such as ``PerLayerCompressionPress`` or ``DecodingPress`` -- it keeps
    kvpress's count for that value, ``max(1, int(n * (1 - compression_ratio)))``.
    """

    def __init__(self, policy: Policy, compression_ratio: float | None = None, *,
                 exact_compression_ratio: float | None = None) -> None:
        self.policy = policy
        self.exact_compression_ratio = exact_compression_ratio  # 1 - 1/ratio (to_press computes it)
        self.compression_ratio = self.exact_compression_ratio if compression_ratio is None else compression_ratio
        self._shared: dict[str, Any] = {}  # the policy's cross-layer scratch for one prefill (ChunkKV's reuse)
        self._last_layer = -1

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
        target = self.policy.target_rows("context_end", budget=budget, resident=n, block_rows=n, seen=n)
        return n if target is None else target

    # --- the rows a kvzoo selector reads -----------------------------------------------------------------------
    def rows(self, module: nn.Module, hidden_states: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
             kwargs: dict) -> RowsView:
        """The layer's rows as the selector sees them in kvzoo's runtime after an unpadded prefill."""
        B, G, n, _ = keys.shape
        layer = module.layer_idx
        if layer <= self._last_layer:  # a new prefill: the cross-layer scratch starts over
            self._shared = {}
        self._last_layer = layer
        slots = torch.arange(n, device=keys.device).expand(B, G, n)
        valid = torch.ones(B, G, n, dtype=torch.bool, device=keys.device)
        scaling = getattr(module, "scaling", module.head_dim ** -0.5)
        policy = self.policy
        window_fn, w = None, 0
        if "window" in policy.observes and policy.observation_window > 0:
            w = min(policy.observation_window, n)

            def window_fn() -> torch.Tensor:  # [B, H, w, n], computed only if the selector reads it
                queries = recomputed_queries(module, hidden_states, kwargs, last=w)
                return window_attention(queries, torch.arange(n - w, n, device=keys.device), keys, slots, valid, scaling)

        row_stats = {name: torch.zeros(B, G, n, dtype=torch.float32, device=keys.device)
                     for name in policy.new_row_stats()}
        if "accumulate" in policy.observes:  # H2O: the attention every row received from the prefill's queries
            queries = recomputed_queries(module, hidden_states, kwargs)
            _, sums = attention_reference(queries, keys, values, slots, valid, torch.arange(n, device=keys.device),
                                          scaling, column_sums=True)
            row_stats["attention"] = sums
        return RowsView(
            keys=keys, values=values, slots=slots, valid=valid, layer_idx=layer,
            num_layers=module.config.num_hidden_layers, layout="gqa", layer_rank=layer, window_fn=window_fn,
            window_queries=w, row_stats=row_stats, shared=self._shared,
        )

    def compress(self, module: nn.Module, hidden_states: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                 attentions: torch.Tensor, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor]:
        n = keys.shape[2]
        keep = self.kept_rows(n)
        if self.compression_ratio == 0 or keep >= n or self.policy.is_dense(module.layer_idx):
            return keys, values
        kept = self.policy.select(self.rows(module, hidden_states, keys, values, kwargs), keep)  # [B, G, keep] sorted
        keys = keys.gather(2, kept[..., None].expand(-1, -1, -1, keys.shape[-1])).contiguous()
        values = values.gather(2, kept[..., None].expand(-1, -1, -1, values.shape[-1])).contiguous()
        return keys, values


class KvzooScorerPress(KvzooPress, ScorerPress):
    """A score-based kvzoo selector as a kvpress ``ScorerPress``: ``score()`` is ``policy.priority``, so kvpress's
    wrappers that take their own top-k (``ChunkKVPress``, ``KeyRerotationPress``, ``AdaKVPress``, ...) compose.

    Alone (and under wrappers that call ``compress``) it keeps exactly what ``policy.select`` keeps, ties to the
    earlier row; the rows a selector always keeps (SnapKV's window, the sinks, the recent rows) score one above
    the best other row, as kvpress's own presses pad their windows.
    """

    def score(self, module: nn.Module, hidden_states: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
              attentions: torch.Tensor, kwargs: dict) -> torch.Tensor:
        n = keys.shape[2]
        rows = self.rows(module, hidden_states, keys, values, kwargs)
        priority = self.policy.priority(rows, min(n, self.kept_rows(n)))  # [B, G, n] fp32, forced rows +inf
        forced = priority == torch.inf
        others = priority[~forced]
        top = others.max() if others.numel() else priority.new_zeros(())
        return torch.where(forced, top + 1, priority)
