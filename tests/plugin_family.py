"""A model family added from outside kvzoo, as a package would ship it: one adapter class, one hook.

The family is a Llama under a model type kvzoo does not know (``"toy_llama"``: a fork of Llama that keeps
its attention): its rows are one KV head's rotated key and value, so the adapter is GQA's with the model
type it serves. tests/test_layers.py registers this module with ``kvzoo.registry.register_plugin`` and runs
a policy on such a model; a package would declare it in the ``kvzoo`` entry-point group instead.
"""

from __future__ import annotations

from typing import ClassVar

import kvzoo.registry
from kvzoo.framework.adapters.gqa import GQAAdapter


class ToyLlamaAdapter(GQAAdapter):
    """Llama's geometry and attention, under the model type ``toy_llama``."""

    name: ClassVar[str] = "toy_llama"
    model_types: ClassVar[tuple[str, ...]] = ("toy_llama",)


@kvzoo.registry.hookimpl
def kvzoo_adapters() -> list[type]:
    return [ToyLlamaAdapter]
