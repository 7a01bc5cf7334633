"""The leaderboard's metrics, each a small function of numbers the runner collects: RULER's string-match scores,
VestigeKV's needle-intact test (ΔNLL below 1 nat), ΔCE, and costs from ``cache.stats().totals`` snapshots (resident
and freed KV bytes, KV-path bytes and fetched rows per decode step) and the process's peak RSS.
"""

from __future__ import annotations

import re
import resource
import sys
import time
from collections.abc import Mapping, Sequence

INTACT_THRESHOLD_NATS = 1.0  # VestigeKV: a needle is intact when its answer's ΔNLL < 1 nat
KV_BYTES_KEY = "kv_bytes_read"
BOUND_VIOLATIONS_KEY = "bound_violations"


# --- quality -------------------------------------------------------------------------------------


def _clean(prediction: str) -> str:
    """RULER's post-processing: strip, control characters to newlines."""
    return re.sub(r"[\x00-\x1f]", "\n", prediction.strip())


def string_match_all(prediction: str, references: Sequence[str]) -> float:
    """RULER's ``string_match_all``: the fraction of ``references`` that occur in ``prediction`` (case-insensitive)."""
    if not references:
        raise ValueError("string_match_all needs at least one reference answer")
    pred = _clean(prediction).lower()
    return sum(ref.lower() in pred for ref in references) / len(references)


def string_match_part(prediction: str, references: Sequence[str]) -> float:
    """RULER's ``string_match_part``: 1.0 if any of ``references`` occurs in ``prediction``, else 0.0."""
    if not references:
        raise ValueError("string_match_part needs at least one reference answer")
    pred = _clean(prediction).lower()
    return float(any(ref.lower() in pred for ref in references))


STRING_METRICS = {"string_match_all": string_match_all, "string_match_part": string_match_part}


def string_match(metric: str, prediction: str, references: Sequence[str]) -> float:
    """Score ``prediction`` with the named RULER metric (``string_match_all`` or ``string_match_part``)."""
    if metric not in STRING_METRICS:
        raise ValueError(f"unknown metric {metric!r}; valid: {', '.join(STRING_METRICS)}")
    return STRING_METRICS[metric](prediction, references)


def delta_nll(compressed_nll: float, full_nll: float) -> float:
    """ΔNLL (nats): the answer's summed NLL under the compressed cache minus under the full cache."""
    return compressed_nll - full_nll


def is_intact(compressed_nll: float, full_nll: float, threshold: float = INTACT_THRESHOLD_NATS) -> bool:
    """The needle is intact when ``delta_nll < threshold`` (1 nat)."""
    return delta_nll(compressed_nll, full_nll) < threshold


def mean_token_nll(token_nll: Sequence[float]) -> float:
    """Cross-entropy (nats per token) of a teacher-forced text from its per-token NLLs."""
    if not token_nll:
        raise ValueError("no tokens to average")
    return sum(token_nll) / len(token_nll)


# --- cost ----------------------------------------------------------------------------------------


def resident_kv_bytes(totals: Mapping[str, float]) -> int:
    """Bytes of the attended tier (keys + values, all layers)."""
    return int(totals["resident_bytes"])


def kv_bytes_freed(totals: Mapping[str, float]) -> int:
    """Attended-tier bytes no longer held compared with keeping every row: (seen − resident) rows × bytes per row
    (archived rows still take memory in the archive tier)."""
    resident_rows = totals["resident_rows"]
    if resident_rows == 0:
        return 0
    per_row = totals["resident_bytes"] / resident_rows
    return int(round((totals["seen_rows"] - resident_rows) * per_row))


def kv_bytes_read_per_step(start: Mapping[str, float], end: Mapping[str, float], steps: int) -> float | None:
    """Mean KV-path bytes read per decode step (attended tier, index scanned, rows fetched): the increase of
    ``kv_bytes_read`` between the ``start`` and ``end`` totals over ``steps``; None when there were no steps."""
    if steps <= 0:
        return None
    return (end.get(KV_BYTES_KEY, 0) - start.get(KV_BYTES_KEY, 0)) / steps


def index_bytes_per_step(start: Mapping[str, float], end: Mapping[str, float], steps: int) -> float | None:
    """Mean bytes of retrieval-index entries scanned per decode step (``index_bytes_scanned`` increase / steps):
    the index's part of :func:`kv_bytes_read_per_step`. None with no steps or no retrieval tier."""
    if steps <= 0 or "index_bytes_scanned" not in end:
        return None
    return (end["index_bytes_scanned"] - start.get("index_bytes_scanned", 0)) / steps


def rows_fetched_per_step(start: Mapping[str, float], end: Mapping[str, float], steps: int) -> float | None:
    """Mean archived rows fetched back per decode step (``fetched_rows`` increase / steps); None with no steps."""
    if steps <= 0:
        return None
    return (end.get("fetched_rows", 0) - start.get("fetched_rows", 0)) / steps


def bound_violations(totals: Mapping[str, float]) -> int | None:
    """Bound violations the retrieval tier counted (``policy_info["bound_violations"]``); None if not reported."""
    value = totals.get(BOUND_VIOLATIONS_KEY)
    return None if value is None else int(value)


def peak_rss_bytes() -> int:
    """The process's peak resident memory so far, in bytes (Linux's ``VmHWM``, elsewhere ``ru_maxrss``): a high-water
    mark of everything the process ever held, so it never decreases."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # bytes on macOS, KiB on Linux


def copy_bandwidth(device: str, gib: float = 1.0) -> float:
    """Bytes moved per second by a ``gib`` GiB device copy (read + write), best of 10: the bandwidth the GPU
    benchmarks compare their kernels and steps against."""
    import torch

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    n = int(gib * 2**30) // 4
    src = torch.empty(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(10):
        sync()
        t = time.perf_counter()
        dst.copy_(src)
        sync()
        best = min(best, time.perf_counter() - t)
    del src, dst
    return 2 * n * 4 / best
