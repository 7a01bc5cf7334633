"""The compile gate: every Triton configuration kvzoo ships compiles for sm_90 (H100/H200) on this CPU-only
machine, and the compiled code has the structure it was built for (kvzoo/kernels/compile_gate.py): shared
memory within the limit, no register spills, the registers and programs per SM the launch heuristic assumes,
tensor-core products (``mma.sync``; FMA for the index scans' IEEE fp32), two row tiles in flight in every
decode-attention variant, each score computed by the warps expected.

``kvzoo/kernels/shapes.py`` lists the configurations the kernels ship. ``pytest -s tests/test_compile_gate.py`` (or
``python -m kvzoo.kernels.shapes``) prints the tables.
Each configuration is compiled once per session (and Triton caches the binaries on disk).
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

triton = pytest.importorskip("triton", reason="SKIPPED LOUDLY: the compile gate needs triton (pip install 'triton==3.7.1')")

from kvzoo.kernels import shapes  # noqa: E402
from kvzoo.kernels.compile_gate import (  # noqa: E402
    compile_sm90,
    grid_markdown,
    problems,
    structure_table,
)
from kvzoo.kernels.decode_attention.triton import split_config  # noqa: E402
from kvzoo.kernels.shapes import shipped  # noqa: E402

CONFIGS = shipped()


def test_the_expected_triton_compiles():
    """``make test-triton36`` sets KVZOO_EXPECT_TRITON=3.6: the gate must then really run on Triton 3.6."""
    expected = os.environ.get("KVZOO_EXPECT_TRITON")
    if expected:
        assert triton.__version__.startswith(expected), f"expected Triton {expected}, imported {triton.__version__}"


def test_some_configuration_ships_and_every_decode_variant_is_held_to_its_structure():
    assert CONFIGS, "kvzoo/kernels/shapes.py lists no configuration"
    splits = [c for c in CONFIGS if c.name.startswith("decode_split-")]
    assert len(splits) == len(shapes.SHIPPED_SHAPES) * len(shapes.SHIPPED_DTYPES) * len(shapes.SHIPPED_VARIANTS)
    for config in splits:
        assert {"mma", "row_buffers", "ctas_per_sm", "score_copies", "max_registers"} <= set(config.expect)
        assert config.expect["mma"].startswith("mma.sync") and config.expect["row_buffers"] >= 2


@pytest.mark.parametrize("config", CONFIGS, ids=[c.name for c in CONFIGS])
def test_compiles_for_sm90_with_the_structure_it_was_built_for(config):
    usage = compile_sm90(config)
    print(usage)
    assert not problems(config, usage), f"{config.name}: {problems(config, usage)}"


def test_the_tables():
    """The compiled structure of every configuration and the grid the splits heuristic gives on 132 SMs."""
    print()
    print(structure_table([(c, compile_sm90(c)) for c in CONFIGS]))
    print()
    print(grid_markdown(shapes.grid_table(132)))
    for row in shapes.grid_table(132):  # the heuristic's wave is the compiled occupancy
        fits = row["batch"] * row["groups"] * (row["splits"] + 1) > row["slots"]
        assert row["programs"] <= max(row["slots"], row["batch"] * row["groups"]) and (fits or row["splits"] == row["tiles"])


def _mla_pool(**changes):
    config = next(c for c in CONFIGS if c.name == "decode_split-mla576-v512-h16-bf16-pool")
    return dataclasses.replace(config, **changes)


def test_the_gate_fails_a_configuration_that_loses_its_pipelining():
    config = _mla_pool(name="unpipelined", num_stages=1)
    found = problems(config, compile_sm90(config))
    assert any("pipelining lost" in p for p in found), found


def test_the_gate_fails_a_configuration_that_loses_its_tensor_cores():
    """fp32 rows with IEEE products: FMA, not mma.sync (what a change that broke the dot's operand types would do)."""
    cfg = split_config(16, 576, 512, False, 4)
    signature, constexprs = shapes.split_specialisation(cfg, torch.float32, 512, False,
                                                         shapes.SHIPPED_VARIANTS["pool"])
    config = _mla_pool(name="fp32-rows", signature=signature, constexprs=constexprs)
    found = problems(config, compile_sm90(config))
    assert any("tensor-core path is lost" in p for p in found), found
