"""kvzoo's reference MLA models, the tiny NoPE/RoPE twin pair, and their checkpoints; importing this package registers
``kvzoo_mla`` with transformers' Auto classes, so ``AutoModelForCausalLM.from_pretrained(<saved dir>)`` loads one.
"""

from __future__ import annotations

import pathlib

from transformers import AutoConfig, AutoModelForCausalLM

from kvzoo.refmodel.modeling import KvzooMLAConfig, KvzooMLAForCausalLM, KvzooMLAModel

CHECKPOINT_DIR = pathlib.Path(__file__).parent / "checkpoints"

AutoConfig.register("kvzoo_mla", KvzooMLAConfig, exist_ok=True)  # exist_ok: a re-import registers it again
AutoModelForCausalLM.register(KvzooMLAConfig, KvzooMLAForCausalLM, exist_ok=True)


def checkpoint_path(name: str) -> pathlib.Path:
    """Folder of a shipped checkpoint: ``"ref-nope"`` / ``"ref-rope"`` (seed 0) or ``"ref-nope-s1"`` etc."""
    folder = name if name.rsplit("-", 1)[-1].startswith("s") and name.count("-") == 2 else f"{name}-s0"
    path = CHECKPOINT_DIR / folder
    if not (path / "config.json").is_file():
        shipped = sorted(p.name for p in CHECKPOINT_DIR.glob("*") if (p / "config.json").is_file())
        raise FileNotFoundError(f"no shipped reference checkpoint {name!r} (looked in {path}); shipped: {shipped}")
    return path


__all__ = ["CHECKPOINT_DIR", "KvzooMLAConfig", "KvzooMLAForCausalLM", "KvzooMLAModel", "checkpoint_path"]
