"""What a layer observed for its policy since its last event (``KVLayer.observed``): the latest queries of the
observation window, the attention module's inputs (a policy observing "inputs": a kvpress press) and the softmax
scale; and the two views a selector reads of them (:meth:`Observed.window`, :meth:`Observed.attention_inputs`)."""

from __future__ import annotations

import weakref
from typing import Any

import torch

from kvzoo.framework.policy import AttentionInputs, WindowQueries


class Observed:
    """One layer's observations for its policy (module docstring)."""

    def __init__(self) -> None:
        self.scaling: float | None = None  # the attention's softmax scale (for the observation window)
        self.queries: torch.Tensor | None = None  # [B, H, w, D], the latest queries (until the context ends)
        self.inputs: dict[str, Any] = {}  # since the last event: the attention module (a weak reference), its inputs

    def record_queries(self, query: torch.Tensor, window: int) -> None:
        """Keep the latest ``window`` queries of ``query [B, H, q, D]`` with those kept before."""
        query = query[:, :, -window:]
        joined = query if self.queries is None else torch.cat([self.queries, query], dim=2)
        # a copy: a view would keep the forward's whole query tensor [B, H, n, D] alive with the layer (30 x 9 MiB
        # for SmolLM2 at 4k: a prefill's peak grew by a layer's queries per layer)
        self.queries = joined[:, :, -window:].detach().clone()

    def record_inputs(self, module: torch.nn.Module, hidden_states: torch.Tensor,
                      position_embeddings: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Keep what the attention module was given (``[B, q, d]`` and its RoPE)."""
        inputs = self.inputs
        inputs["module"] = weakref.ref(module)
        inputs.setdefault("hidden_states", []).append(hidden_states.detach())
        if position_embeddings is not None:
            inputs.setdefault("position_embeddings", []).append(tuple(t.detach() for t in position_embeddings))

    def window(self, size: int, seen: int) -> WindowQueries:
        """The latest ``size`` queries as :class:`RowsView` reads them (some were kept)."""
        queries = self.queries[:, :, -size:]
        return WindowQueries(queries.shape[2], seen, self.scaling, lambda: queries)

    def _joined(self, start: int, stop: int | None) -> tuple[torch.Tensor, Any]:
        """The recorded hidden states and RoPE of rows ``[start, stop)`` since the last event."""
        recorded = self.inputs
        hidden_states = torch.cat(recorded["hidden_states"], dim=1)[:, start:stop]
        position_embeddings = None
        if "position_embeddings" in recorded:
            cos, sin = zip(*recorded["position_embeddings"])
            position_embeddings = (torch.cat(cos, dim=1)[:, start:stop], torch.cat(sin, dim=1)[:, start:stop])
        return hidden_states, position_embeddings

    def attention_inputs(self, rows: int) -> AttentionInputs:
        """The "inputs" observation of the first ``rows`` rows since the last event (some were recorded). A forward
        still in flight (generate's first decode step, which ends the context before its own row is appended)
        recorded its input already: left out by ``rows``."""
        return AttentionInputs(self.inputs["module"](), *self._joined(0, rows))

    def drop_inputs(self, rows: int | None = None) -> None:
        """The first ``rows`` rows' inputs are no longer observed (a block closed over them; None: all, an event)."""
        if rows is None:
            self.inputs = {}
        elif self.inputs:
            hidden_states, position_embeddings = self._joined(rows, None)
            self.inputs["hidden_states"] = [hidden_states]
            if position_embeddings is not None:
                self.inputs["position_embeddings"] = [position_embeddings]

    def select_batch(self, idx: torch.Tensor) -> None:
        if self.queries is not None:
            self.queries = self.queries.index_select(0, idx)

    def repeat_batch(self, repeats: int) -> None:
        if self.queries is not None:
            self.queries = self.queries.repeat_interleave(repeats, dim=0)
