"""The names of the models kvzoo runs (:data:`MODEL_NAMES`) and the check of a ``--model`` value, without torch:
the CLI refuses a misspelt model before it imports torch. :mod:`kvzoo.models` loads them (and re-exports these names).
"""

from __future__ import annotations

import pathlib

# Trained reference twins shipped in kvzoo/refmodel/checkpoints (benchmarks/refmodels/README.md):
# "ref-nope" / "ref-rope" = seed 0; "ref-nope-s1", "ref-rope-s2", ... name the other training seeds.
REF_MODEL_PREFIXES = ("ref-nope", "ref-rope")
REF_MODEL_NAMES = ("ref-nope", "ref-rope", "ref-nope-s1", "ref-nope-s2", "ref-rope-s1", "ref-rope-s2")
MODEL_NAMES = ("smollm2-135m", "gemma3-270m", "tiny-llama", "tiny-deepseek-v2", "tiny-kimi-linear", "tiny-gemma3", *REF_MODEL_NAMES)


def looks_like_hub_id(name: str) -> bool:
    """``owner/name`` that is not a local path: a model on the Hugging Face hub."""
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "~", "/"))


def check_model_name(name: str) -> None:
    """Raise a ValueError naming the valid models unless ``name`` is one, a local directory holding a transformers
    model (its ``config.json``), or a hub id."""
    path = pathlib.Path(name).expanduser() if isinstance(name, str) else None
    if path is not None and path.is_dir() and name not in MODEL_NAMES:
        if not (path / "config.json").is_file():
            raise ValueError(f"model {name!r}: the directory {str(path)!r} holds no config.json, so it is not a "
                             "transformers model directory (one written by save_pretrained: config.json and the "
                             f"weights); valid models are {', '.join(MODEL_NAMES)}, a local directory holding a "
                             "transformers model, or a hub id")
        return
    if isinstance(name, str) and (name in MODEL_NAMES or looks_like_hub_id(name)):
        return
    raise ValueError(
        f"unknown model {name!r}: valid names are {', '.join(MODEL_NAMES)}, a local directory holding a "
        "transformers model, or a hub id such as 'HuggingFaceTB/SmolLM2-360M-Instruct' (needs a network)"
    )
