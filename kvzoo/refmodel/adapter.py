"""The reference twins' model family (``model_type="kvzoo_mla"``, registered through ``registry.toml``): the twin's
own :func:`~kvzoo.refmodel.modeling.rotate_branch` rotates the branch (RoPE arm) or not (NoPE arm), so the
framework's adapters know nothing of the twins.
"""

from __future__ import annotations

from typing import Any

from kvzoo.framework.adapters.mla import MLAAdapter
from kvzoo.refmodel.modeling import rotate_branch


class ReferenceMLAAdapter(MLAAdapter):
    """The MLA twins: every layer MLA; the branch rotated as ``config.rope_branch`` says."""

    name = "kvzoo_mla"
    model_types = ("kvzoo_mla",)
    rotate = staticmethod(rotate_branch)

    @classmethod
    def branch_is_rotated(cls, config: Any) -> bool:
        return bool(getattr(config, "rope_branch", True))
