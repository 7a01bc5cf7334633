"""Comparing two greedy decodes that were computed along different numerical routes.

Two runs that compute the same logits by other means (kvzoo's attention against SDPA, a sequence alone against
the same sequence in a batch, two processes) agree to rounding, not bit for bit: which rounding a BLAS call takes
depends on shapes, strides and threads, so a test that holds them equal bit for bit can fail on another machine.
Greedy tokens are the argmax of those logits: they are identical except where the reference's two best logits lie
within rounding of each other (a near tie), where either token is a correct greedy choice. :func:`assert_same_greedy`
requires identical tokens up to the first difference, that difference to be at a near tie of the reference, and
the logits before it to agree within ``atol``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

NEAR_TIE = 1e-4  # fp32 logits of the tiny models agree to ~1e-6; a gap this small may flip under rounding


def assert_same_greedy(ref_tokens: torch.Tensor, out_tokens: torch.Tensor,
                       ref_logits: Sequence[torch.Tensor] | torch.Tensor | None = None,
                       out_logits: Sequence[torch.Tensor] | torch.Tensor | None = None, *,
                       atol: float = 1e-4, near_tie: float = NEAR_TIE) -> None:
    """``ref_tokens``/``out_tokens`` ``[T]`` greedy tokens; ``*_logits`` the logits each step chose from (``[T, V]``
    or a sequence of ``[V]``). Without logits the tokens must be identical."""
    ref_tokens, out_tokens = ref_tokens.reshape(-1), out_tokens.reshape(-1)
    assert ref_tokens.shape == out_tokens.shape, f"{ref_tokens.shape[0]} tokens against {out_tokens.shape[0]}"
    differ = (ref_tokens != out_tokens).nonzero()
    steps = ref_tokens.shape[0] if differ.numel() == 0 else int(differ[0])
    if ref_logits is None:
        assert steps == ref_tokens.shape[0], f"token {steps} differs: {ref_tokens.tolist()} vs {out_tokens.tolist()}"
        return
    ref = torch.stack(list(ref_logits)) if not isinstance(ref_logits, torch.Tensor) else ref_logits
    if out_logits is not None:
        out = torch.stack(list(out_logits)) if not isinstance(out_logits, torch.Tensor) else out_logits
        gap = (ref[:steps] - out[:steps]).abs().max().item() if steps else 0.0
        assert gap < atol, f"the logits differ by {gap:.3g} (> {atol:g}) before any token differs"
    if steps < ref_tokens.shape[0]:
        top2 = ref[steps].float().topk(2).values
        margin = float(top2[0] - top2[1])
        assert margin < near_tie, (
            f"token {steps} differs ({int(ref_tokens[steps])} vs {int(out_tokens[steps])}) where the reference's best "
            f"logit leads by {margin:.3g}, not a near tie (< {near_tie:g})")


def generated_logits(out, row: int = 0) -> torch.Tensor:
    """``[T, V]``: the logits of ``generate(..., output_logits=True, return_dict_in_generate=True)`` for ``row``."""
    return torch.stack([step[row] for step in out.logits])
