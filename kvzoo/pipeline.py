"""``kvzoo.pipeline``: question-after-compression generation and scoring, and their steps (see ``framework/pipeline.py``)."""

from kvzoo.framework.pipeline import (
    QUESTION_POSITIONS,
    TEACHER_FORCING,
    ContinuationResult,
    DeltaCE,
    GenerationResult,
    ScoreResult,
    build_prompt,
    cache_kwargs,
    compress,
    continuation_nll,
    delta_ce,
    eos_ids,
    generate,
    greedy_decode,
    prefill,
    score,
    teacher_forced_nll,
)

__all__ = [
    "QUESTION_POSITIONS", "TEACHER_FORCING", "ContinuationResult", "DeltaCE", "GenerationResult", "ScoreResult",
    "build_prompt", "cache_kwargs", "compress", "continuation_nll", "delta_ce", "eos_ids", "generate",
    "greedy_decode", "prefill", "score", "teacher_forced_nll",
]
