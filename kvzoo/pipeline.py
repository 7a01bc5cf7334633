"""``kvzoo.pipeline``: question-after-compression generation and scoring (see ``framework/pipeline.py``)."""

from kvzoo.framework.pipeline import (
    QUESTION_POSITIONS,
    GenerationResult,
    ScoreResult,
    build_prompt,
    generate,
    score,
)

__all__ = ["QUESTION_POSITIONS", "GenerationResult", "ScoreResult", "build_prompt", "generate", "score"]
