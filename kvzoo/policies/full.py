"""``full``: keep every row. The reference every other policy is measured against."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvzoo.framework.policy import Policy, RowsView


@dataclass
class Full(Policy):
    """Keep everything: no event ever evicts a row, so the model runs unmodified.

    Passing ``ratio`` or ``budget`` is an error rather than silently ignored.
    """

    name: ClassVar[str] = "full"
    summary: ClassVar[str] = "keep every row (the unmodified model)"
    paper: ClassVar[str] = ""
    requires_budget: ClassVar[bool] = False

    def validate(self) -> None:
        super().validate()
        if self.ratio is not None or self.budget is not None:
            raise ValueError(
                f"full keeps every row and takes no ratio/budget (got ratio={self.ratio}, budget={self.budget}); "
                "use a compressing policy such as streaming_llm for a budget"
            )

    def target_rows(self, event, *, budget, resident, block_rows=0, seen=0):
        return None

    def priority(self, rows: RowsView, keep: int) -> torch.Tensor:
        raise RuntimeError("full never evicts; no row is ever scored")
