"""Bridges to other KV-cache libraries (today NVIDIA's kvpress, both ways: :mod:`kvzoo.integrations.kvpress`), each
importing its library lazily: kvzoo never needs them installed.
"""
