"""Bridges to other KV-cache libraries. Each imports its library lazily: kvzoo never needs them installed.

* :mod:`kvzoo.integrations.kvpress` -- NVIDIA's kvpress, both ways: kvzoo policies as presses
  (:func:`~kvzoo.integrations.kvpress.to_press`) and kvpress presses as kvzoo policies
  (``registry.get("kvpress:KnormPress", compression_ratio=0.5)``).
"""
