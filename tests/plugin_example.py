"""A minimal third-party kvzoo plugin, as a package would ship it: one policy, one hook.

tests/test_registry.py registers this module with ``kvzoo.registry.register_plugin`` and, copied
into a temporary directory beside a ``*.dist-info`` folder, through the ``kvzoo`` entry-point group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

import kvzoo.registry
from kvzoo.framework.policy import Policy, RowsView


@dataclass
class KeepFirst(Policy):
    """Keep the first ``keep`` rows of the attended tier, whatever they hold (a toy)."""

    name: ClassVar[str] = "keep_first"
    summary: ClassVar[str] = "keep the first rows (test plugin)"
    layouts: ClassVar[tuple[str, ...]] = ("gqa",)

    def priority(self, rows: RowsView, keep: int) -> torch.Tensor:
        return -torch.arange(rows.num_rows, dtype=torch.float32, device=rows.valid.device).expand(rows.valid.shape)


@kvzoo.registry.hookimpl
def kvzoo_policies() -> list[type[Policy]]:
    return [KeepFirst]
