"""The docs' kvpress blocks (``# kvzoo: needs kvpress``), run as written in kvpress's environment: the main suite's
``tests/test_docs_blocks.py`` skips them there, saying this file runs them."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.test_docs_blocks import ALL, Block, run_block

KVPRESS_BLOCKS = [b for b in ALL if b.marker == "needs kvpress"]


def test_the_docs_hold_a_kvpress_block():
    assert KVPRESS_BLOCKS


@pytest.mark.parametrize("block", KVPRESS_BLOCKS, ids=lambda b: b.name)
def test_kvpress_docs_block_runs_as_written(block: Block, monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    run_block(block, monkeypatch, tmp_path)
