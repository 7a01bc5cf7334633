"""What ships: the Triton specialisations the launchers pick for the shipped models, for the sm_90 compile gate
(``tests/test_compile_gate.py`` compiles each one and holds it to ``expect``; ``python -m kvzoo.kernels.shapes``
prints the tables). Each is built from the launchers' own heuristics (``split_config``, ``merge_config``,
``index_scan.launch_config``), so the binary a GPU runs is the one the gate checks. This module imports the gate and
the kernel modules; neither imports it.
"""

from __future__ import annotations

import torch

from kvzoo.kernels import index_scan
from kvzoo.kernels.compile_gate import KernelConfig, compile_sm90, grid_markdown, structure_table
from kvzoo.kernels.decode_attention import triton as decode
from kvzoo.kernels.decode_attention.triton import (
    DEFAULT_SMS,
    MergeConfig,
    SplitConfig,
    default_splits,
    merge_config,
    split_config,
)

# ----------------------------------------------------------------------------------------------------
# decode attention
# ----------------------------------------------------------------------------------------------------

# (name, heads per KV group, key width D, value width Dv, separate values)
SHIPPED_SHAPES = (
    ("mla576-v512-h16", 16, 576, 512, False),  # DeepSeek-V2-Lite: 16 heads over one latent group
    ("mla576-v512-h32", 32, 576, 512, False),  # Kimi Linear 48B's MLA layers: 32 heads
    ("gqa64-hpg3", 3, 64, 64, True),  # SmolLM2-135M: 9 heads / 3 KV heads
    ("gqa128-hpg4", 4, 128, 128, True),
    ("gqa128-hpg8", 8, 128, 128, True),
)
SHIPPED_DTYPES = (torch.bfloat16, torch.float16)
# the optional inputs change the code: a plain dense pool (every row valid), a pool with valid flags and a device
# length that also returns its best score (the runtime's tier in a retrieving step), and every option on (gathered
# rows with flags). The pool and gathered variants' row loads wait on a flag or an index: they get their own stages.
SHIPPED_VARIANTS = {
    "dense": {"GATHER": False, "HAS_FLAGS": False, "HAS_LENGTH": False, "BEST": False},
    "pool": {"GATHER": False, "HAS_FLAGS": True, "HAS_LENGTH": True, "BEST": True},
    "gathered": {"GATHER": True, "HAS_FLAGS": True, "HAS_LENGTH": True, "BEST": False},
}
# the merge kernel as the op launches it: a whole step in one call, the deferred part of a retrieving step (fp32
# output and the best score) and the part that ends it (the deferred part folded in)
SHIPPED_MERGES = {
    "plain": {"HAS_LENGTH": True, "HAS_PRIOR": False, "BEST": False, "PRIOR_BEST": False},
    "deferred": {"HAS_LENGTH": False, "HAS_PRIOR": False, "BEST": True, "PRIOR_BEST": False},
    "prior": {"HAS_LENGTH": False, "HAS_PRIOR": True, "BEST": False, "PRIOR_BEST": False},
}
# the (batch, positions) cases the compile gate prints the grid of: the whole context and its 1/32 kept in the tier
# (32k and 128k rows), and a retriever's 16 fetched rows
GRID_CASES = tuple((b, n) for b in (1, 4, 8) for n in (16, 1024, 4096, 32_768, 131_072))
_TRITON_TYPE = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.int32: "i32",
                torch.int64: "i64"}


def split_specialisation(cfg: SplitConfig, dtype: torch.dtype, value_width: int, separate_values: bool,
                         flags: dict[str, bool], index_dtype: torch.dtype = torch.int64,
                         length_dtype: torch.dtype = torch.int64,
                         heads_per_group: int = 16) -> tuple[dict[str, str], dict[str, object]]:
    """The split kernel's argument types and constexprs for the compile gate, as the launcher passes them
    (an absent optional tensor is passed as the keys, so it has their type)."""
    elem = "*" + _TRITON_TYPE[dtype]
    pointer = {
        "Q": elem, "K": elem, "V": elem,
        "LENGTH": "*" + _TRITON_TYPE[length_dtype] if flags["HAS_LENGTH"] else elem,
        "IDX": "*" + _TRITON_TYPE[index_dtype] if flags["GATHER"] else elem,
        "FLAGS": "*i32" if flags["HAS_FLAGS"] else elem,
        "PART_O": "*fp32", "PART_L": "*fp32", "PART_M": "*fp32",
    }
    ints = ["n_pool", "n_pos", "stride_lb", "stride_qb", "stride_qh", "stride_kb", "stride_kg", "stride_kn",
            "stride_vb", "stride_vg", "stride_vn", "stride_ib", "stride_ig", "stride_ik",
            "stride_fb", "stride_fg", "stride_fw", "groups", "hpg", "splits"]
    constexprs = {
        "D1": cfg.D1, "D2": cfg.D2, "DV": value_width, "BLOCK_H": cfg.BLOCK_H, "BLOCK_N": cfg.BLOCK_N,
        "BLOCK_D1": cfg.BLOCK_D1, "BLOCK_D2": cfg.BLOCK_D2, "BLOCK_DV": cfg.BLOCK_DV,
        "FLAG_WORDS": -(-heads_per_group // 32),
        "SEPARATE_V": separate_values, **flags, "FP32": dtype == torch.float32,
        "ALIGNED": True,  # the shipped shapes' row strides (576, 64, 128 elements) and torch's allocations
    }
    signature = {**pointer, "scale_log2": "fp32", **{name: "i32" for name in ints},
                 **{name: "constexpr" for name in constexprs}}
    return signature, constexprs


def merge_specialisation(mcfg: MergeConfig, out_dtype: torch.dtype, prior_dtype: torch.dtype, flags: dict[str, bool],
                         splits: int) -> tuple[dict[str, str], dict[str, object]]:
    """The merge kernel's argument types and constexprs for the compile gate, as the launcher passes them."""
    out = "*" + _TRITON_TYPE[out_dtype]
    pointer = {"PART_O": "*fp32", "PART_L": "*fp32", "PART_M": "*fp32",
               "LENGTH": "*i64" if flags["HAS_LENGTH"] else "*fp32",
               "PRIOR_O": "*" + _TRITON_TYPE[prior_dtype] if flags["HAS_PRIOR"] else out,
               "PRIOR_L": "*fp32", "PRIOR_M": "*fp32", "OUT": out, "LSE": "*fp32", "BEST_OUT": "*fp32"}
    constexprs = {"BLOCK_S": mcfg.BLOCK_S, "BLOCK_DV": mcfg.BLOCK_DV, "ONE_TILE": splits <= mcfg.BLOCK_S, **flags}
    signature = {**pointer, **{name: "i32" for name in ("heads", "n_pos", "stride_lb", "splits", "block_n", "dv")},
                 **{name: "constexpr" for name in constexprs}}
    return signature, constexprs


def grid_table(sms: int = DEFAULT_SMS) -> list[dict[str, object]]:
    """The grid the splits heuristic gives each shipped shape (bf16, its pool variant) for :data:`GRID_CASES` on
    ``sms`` SMs: splits, programs, the programs the chip holds at once (``sms x ctas_per_sm``), and the merge's
    block of splits."""
    rows = []
    for name, hpg, width, value_width, separate in SHIPPED_SHAPES:
        cfg = split_config(hpg, width, value_width, separate, 2)
        groups = 1 if not separate else {3: 3, 4: 8, 8: 4}.get(hpg, 1)  # SmolLM2: 3 KV heads; Llama-like: 8 / 4
        for batch, positions in GRID_CASES:
            splits = default_splits(batch * groups, positions, cfg.BLOCK_N, sms, cfg.ctas_per_sm)
            rows.append({"shape": name, "batch": batch, "groups": groups, "positions": positions,
                         "tiles": -(-positions // cfg.BLOCK_N), "splits": splits,
                         "programs": batch * groups * splits, "slots": sms * cfg.ctas_per_sm,
                         "merge_block_s": merge_config(splits).BLOCK_S})
    return rows


def decode_configs() -> list[KernelConfig]:
    """Every configuration the decode-attention launcher picks for :data:`SHIPPED_SHAPES` x :data:`SHIPPED_DTYPES`
    x :data:`SHIPPED_VARIANTS`, and the merge kernel per output dtype, :data:`SHIPPED_MERGES` variant and block of
    splits the heuristic gives for :func:`grid_table`."""
    kernels = decode.kernels()
    configs = []
    shipped = [(name, hpg, width, value_width, separate, dtype, variant)
               for name, hpg, width, value_width, separate in SHIPPED_SHAPES
               for dtype in SHIPPED_DTYPES for variant in SHIPPED_VARIANTS]
    for name, hpg, width, value_width, separate, dtype, variant in shipped:
        cfg = split_config(hpg, width, value_width, separate, torch.empty((), dtype=dtype).element_size())
        signature, constexprs = split_specialisation(cfg, dtype, value_width, separate, SHIPPED_VARIANTS[variant],
                                                     heads_per_group=hpg)
        elem = _TRITON_TYPE[dtype]
        tiles = [(cfg.BLOCK_N, cfg.BLOCK_D1, elem), (cfg.BLOCK_N, cfg.BLOCK_DV if separate else cfg.BLOCK_D2, elem)]
        expect = {"mma": "mma.sync.m16n8k16", "row_tiles": tiles, "row_buffers": cfg.row_buffers,
                  "ctas_per_sm": cfg.ctas_per_sm, "score_tile": (cfg.BLOCK_H, cfg.BLOCK_N),
                  "score_copies": cfg.score_copies, "max_registers": cfg.max_registers}
        configs.append(KernelConfig(f"decode_split-{name}-{elem}-{variant}", kernels.split, signature, constexprs,
                                    cfg.num_warps, cfg.num_stages, expect=expect))
    block_s = sorted({row["merge_block_s"] for row in grid_table()})
    for dtype in SHIPPED_DTYPES:  # the output dtype changes one cast: one dtype at every block of splits
        for variant, flags in SHIPPED_MERGES.items():
            for bs in block_s if dtype == SHIPPED_DTYPES[0] else block_s[-1:]:
                mcfg = merge_config(bs)
                out_dtype = torch.float32 if variant == "deferred" else dtype
                signature, constexprs = merge_specialisation(mcfg, out_dtype, torch.float32, flags, bs)
                configs.append(KernelConfig(f"decode_merge-{_TRITON_TYPE[dtype]}-{variant}-S{bs}", kernels.merge,
                                            signature, constexprs, mcfg.num_warps, mcfg.num_stages,
                                            expect={"ctas_per_sm": 4}))
    return configs


# ----------------------------------------------------------------------------------------------------
# index scan
# ----------------------------------------------------------------------------------------------------

# Shapes the shipped retrievers scan: (label, query rows hq, width W, entries dtype, op, threshold given). VestigeKV
# MLA: W = rank 64 + eta + rope 64 + 2 norms = 131, fp32, hq 16 / 32 (its certified rule reduces with s* - tau, its
# top-j rule scans); Quest MLA: W = 2 x 576 + 1, hq 16; Quest GQA: W = 129, hq 3 / 4 / 8 (gqa="group" reduces).
INDEX_SCAN_SHAPES = (
    [(f"vestige_mla_h{h}", h, 131, torch.float32, op, op == "reduce") for h in (16, 32) for op in ("scan", "reduce")]
    + [(f"quest_mla_h16_{_TRITON_TYPE[d]}", 16, 1153, d, op, False)
       for d in (torch.bfloat16, torch.float16) for op in ("scan", "reduce")]
    + [(f"quest_gqa_h{h}_{_TRITON_TYPE[d]}", h, 129, d, op, False)
       for h in (3, 4, 8) for d in (torch.bfloat16, torch.float16) for op in ("scan", "reduce")]
)


def index_scan_configs(lengths: tuple[bool, ...] = (False, True)):
    """The :class:`~kvzoo.kernels.compile_gate.KernelConfig` of every specialisation the launcher picks for
    :data:`INDEX_SCAN_SHAPES` (``lengths``: with and/or without a ``length`` tensor, int64)."""
    kernel = index_scan._jit()
    configs = []
    for label, hq, W, dtype, op, has_threshold in INDEX_SCAN_SHAPES:
        for has_length in lengths:
            config = index_scan.launch_config(hq, W)
            warps, stages = config.pop("num_warps"), config.pop("num_stages")
            signature = {"q_ptr": "*fp32", "e_ptr": f"*{_TRITON_TYPE[dtype]}",
                         "thr_ptr": "*fp32" if has_threshold else "constexpr",
                         "len_ptr": "*i64" if has_length else "constexpr", "out_ptr": "*fp32", "scaling": "fp32"}
            signature.update({name: "i32" for name in index_scan._INT_ARGS})
            constexprs = {"REDUCE": op == "reduce", "HAS_THRESHOLD": has_threshold, "HAS_LENGTH": has_length, **config}
            if not has_threshold:
                constexprs["thr_ptr"] = None
            if not has_length:
                constexprs["len_ptr"] = None
            signature.update({name: "constexpr" for name in ("REDUCE", "HAS_THRESHOLD", "HAS_LENGTH", *config)})
            name = f"index_scan_{op}_{label}_W{W}" + ("_length" if has_length else "")
            # the compile gate's expectations: fp32 FMA products (IEEE: a certified bound cannot take TF32), no
            # software pipelining (num_stages 1): the loads' latency is hidden by 3 or more programs per SM
            configs.append(KernelConfig(name, kernel, signature, constexprs, num_warps=warps, num_stages=stages,
                                        expect={"mma": "fma", "ctas_per_sm": 3}))
    return configs


def shipped() -> list[KernelConfig]:
    """Every configuration the kernels ship: the decode-attention kernels' and the index scan's."""
    return decode_configs() + index_scan_configs()


if __name__ == "__main__":  # python -m kvzoo.kernels.shapes: the compile gate's tables, without pytest
    print(structure_table([(c, compile_sm90(c)) for c in shipped()]))
    print()
    print(grid_markdown(grid_table()))
