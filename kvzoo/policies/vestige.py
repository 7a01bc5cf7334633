"""``vestige``: VestigeKV -- a query-independent salience score from the decoupled branch, plus a
certified recall tier over the evicted rows.

In NoPE-MLA models (Kimi Linear) the 64-dim decoupled "RoPE" branch ``r`` of each 576-dim
latent row is never rotated, and training turns it into a salience channel. The selector reads
only that branch (11 % of a row) when a block of rows closes -- before any question exists --
and keeps the rows whose branch carries the most high-frequency energy along the sequence
(paper §4.1). Evicted rows stay bit-exact in the archive; its retriever (``kvzoo/retrievers/vestige.py``:
the certified sketch of §4.2, Lemma 2, on MLA rows, int8 keys on GQA rows) bounds every archived
row's score from a few numbers per row, and each step fetches back the few rows that could matter.
DeepSeek-V2, whose branch *is* rotated, is the control where the same selector should fail.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from kvzoo.framework.policy import Counters, Policy, RowsView, forced_priority, require_int

BRANCHES = ("auto", "rope", "content", "row", "key")


def branch_sigma(branch: torch.Tensor, kappa: int, valid: torch.Tensor | None = None) -> torch.Tensor:
    """σ ``[..., n]``: the norm of each row's branch after removing the lowest ``kappa`` frequency bins.

    ``branch [..., n, d]`` is read along the sequence axis (``n``): ``X = rfft(branch)`` has
    ``n // 2 + 1`` bins per dim; bins ``0 .. kappa-1`` (DC and the slowest drifts) are zeroed, the
    rest transformed back, and σ_u is the Euclidean norm over ``d`` of row u of the result.
    ``kappa = 0`` gives the raw branch norm; ``kappa >= n // 2 + 1`` gives σ = 0 everywhere.
    Padding rows (``valid`` False) are zeroed before the transform. Computed in fp32.
    """
    x = branch.float()
    if valid is not None:
        x = x * valid[..., None].to(x.dtype)
    n = x.shape[-2]
    spectrum = torch.fft.rfft(x, dim=-2)
    spectrum[..., : min(kappa, spectrum.shape[-2]), :] = 0
    return torch.fft.irfft(spectrum, n=n, dim=-2).norm(dim=-1)


@dataclass
class SelectorReads(Counters):
    """What the selector read of the closing blocks (``cache.stats()``'s policy_info)."""

    selector_rows_read: int = 0
    selector_bytes_read: int = 0  # the branch dims of those rows


@dataclass
class Vestige(Policy):
    """Keep, per closed block, the top-m rows by branch σ plus 4 sinks and a recent window.

    Schedule ``"block"``: a block closes when ``block_size`` rows have arrived since the last one closed, or at the end
    of the context (``cache.compress()``, before the question); a forward that adds more closes each full block in
    turn, as if chunked at ``block_size`` (``closes_each_block``). Only the closing block's rows are candidates;
    earlier decisions are final. Per block the kept count is ``floor(block_rows / ratio)`` (or ``budget``): the 4 sinks
    (first block only), the block's last ``recent`` rows (at most half the block's keep, so σ always chooses at least
    half) and the top rows by σ (ties toward earlier rows).

    ``branch`` says what σ reads: ``"auto"`` = the 64-dim branch ``r`` on MLA rows and the whole key on GQA rows (no
    branch there: the operator can still be measured on RoPE models, where the paper predicts it fails); ``"rope"``,
    ``"content"`` (the 512-dim latent), ``"row"`` (MLA only); ``"key"`` (GQA). ``cache.stats()`` reports the bytes
    the selector read (``selector_bytes_read``, ``selector_rows_read``).

    Defaults: ``block_size=8192`` (VestigeKV's blocks of T tokens); ``sinks=4`` (StreamingLLM's count, as the paper
    keeps 4); ``kappa=8`` and ``recent=32`` are kvzoo's choices (the design fixes none); ``retriever="vestige"``
    (``retriever=None`` is eviction only).
    """

    kappa: int = 8
    sinks: int = 4
    recent: int = 32
    block_size: int = 8192
    branch: str = "auto"
    retriever: Any = "vestige"

    name: ClassVar[str] = "vestige"
    summary: ClassVar[str] = ("branch-σ salience per closed block (question-free) + a recall tier over the evicted rows "
                              "(int8 keys on GQA rows, the certified sketch on MLA rows)")
    paper: ClassVar[str] = "VestigeKV (paper §4.1-4.2; kvzoo's docs/fidelity.md)"
    schedule: ClassVar[str] = "block"
    closes_each_block: ClassVar[bool] = True  # blocks of block_size rows, however the context is fed

    def validate(self) -> None:
        super().validate()
        for field_name in ("kappa", "sinks", "recent"):
            require_int(getattr(self, field_name), field_name, 0)
        require_int(self.block_size, "block_size", 1, "rows per closed block")
        if self.branch not in BRANCHES:
            raise ValueError(f"branch must be one of {BRANCHES}, got {self.branch!r}")

    def target_rows(self, event, *, budget, resident, block_rows=0, seen=0):
        """Each closed block on its own: the budget formula applied to the block's rows."""
        if block_rows <= 0:
            return None
        target = resident - block_rows + min(block_rows, self.resolve_budget(block_rows))
        return target if target < resident else None

    def branch_dims(self, rows: RowsView) -> slice:
        width = rows.keys.shape[-1]
        if rows.layout == "mla":
            rope = rows.branch_dim
            choice = "rope" if self.branch == "auto" else self.branch
            dims = {"rope": slice(width - rope, width), "content": slice(0, width - rope), "row": slice(0, width)}
            if choice not in dims:
                raise ValueError(f"vestige: branch={self.branch!r} is for GQA rows; on MLA rows use rope, content or row")
            return dims[choice]
        if self.branch not in ("auto", "key"):
            raise ValueError(f"vestige: branch={self.branch!r} needs MLA rows; on GQA rows use auto or key")
        return slice(0, width)

    def priority(self, rows: RowsView, keep: int) -> torch.Tensor:
        """σ over the closing block; earlier blocks, the sinks and the block's recent rows forced."""
        start = rows.first_new  # the closing block is rows[start:]
        block_rows = rows.num_rows - start
        block_keep = keep - start
        dims = self.branch_dims(rows)
        branch = rows.keys[:, :, start:, dims]  # the only bytes this selector reads
        block_valid = rows.valid[:, :, start:]
        sigma = branch_sigma(branch, self.kappa, block_valid)  # [B, G, block]
        if not bool(block_valid.all()):  # padding: each sequence's sigma over its own rows, as it would be alone
            for b, g in itertools.product(range(block_valid.shape[0]), range(block_valid.shape[1])):
                own = block_valid[b, g].nonzero()[:, 0]
                sigma[b, g] = 0.0
                if own.numel():
                    sigma[b, g, own] = branch_sigma(branch[b, g, own], self.kappa)
        B, G, N = rows.valid.shape
        rows.count(SelectorReads(B * G * block_rows, branch.numel() * branch.element_size()))
        scores = torch.zeros(B, G, N, dtype=torch.float32, device=sigma.device)
        scores[:, :, start:] = sigma
        forced = (torch.arange(N, device=sigma.device) < start).expand(B, G, N).clone()  # earlier blocks: final
        forced |= rows.sinks(self.sinks)  # the sequence's first valid rows
        forced |= rows.recent(min(self.recent, block_keep // 2))  # the block's latest rows (earlier ones are forced)
        return forced_priority(scores, forced, rows.valid)
