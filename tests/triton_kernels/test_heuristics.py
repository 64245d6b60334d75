"""Tile heuristics: the compiled-kernel table choices at the model shapes the issue names, and the
interpreter's few-large-tiles policy and override."""

from __future__ import annotations

import torch

from relibra_moe.triton_kernels.heuristics import (
    DW_CONFIGS,
    GEMM_CONFIGS,
    DwConfig,
    GemmConfig,
    dw_config,
    gemm_config,
    override,
    row_tile,
    table_dw_config,
    table_gemm_config,
)

BF16 = torch.bfloat16


def test_large_slots_get_hopper_tiles():
    # Qwen3-30B-A3B on one rank: T 32768, k 8, E 128 -> 2048 rows per expert; H 2048, FFN 768
    rows = 32768 * 8 / 128
    gate_up = table_gemm_config(rows, 2 * 768, 2048, BF16, gated=True)
    assert gate_up == GEMM_CONFIGS["m128_n256"]
    assert (gate_up.block_m, gate_up.block_n, gate_up.block_k, gate_up.num_warps) == (128, 256, 64, 8)
    assert table_gemm_config(rows, 2048, 768, BF16) == GEMM_CONFIGS["m128_n256"]  # down projection
    # the SwiGLU-backward epilogue never takes the widest entry (it would spill, see test_kernels_sm90)
    bwd = table_gemm_config(rows, 2 * 768, 2048, BF16, gated=True, swiglu_bwd=True)
    assert bwd.swiglu_bwd and bwd.block_m == 128
    assert table_dw_config(rows, 2048, 1536, BF16) == DW_CONFIGS["k128_n256"]


def test_small_slots_keep_small_row_tiles():
    assert table_gemm_config(8, 1536, 2048, BF16).block_m == 16
    assert table_gemm_config(24, 1536, 2048, BF16).block_m == 32
    assert table_gemm_config(100, 1536, 2048, BF16).block_m == 64
    assert table_gemm_config(8, 1536, 2048, torch.float32).block_m == 16
    assert table_dw_config(8, 2048, 1536, BF16) == DW_CONFIGS["k64_n64"]


def test_narrow_problems_narrow_the_tile():
    cfg = table_gemm_config(4096, 48, 40, BF16)
    assert cfg.block_m == 128 and cfg.block_n == 64 and cfg.block_k == 64
    assert table_gemm_config(4096, 48, 24, BF16).block_k == 32
    assert table_gemm_config(4096, 2, 2048, BF16, gated=True).block_n == 32  # gated: >= 16 per half


def test_every_entry_is_well_formed():
    for name, c in GEMM_CONFIGS.items():
        for v in (c.block_m, c.block_n, c.block_k):
            assert v >= 16 and v & (v - 1) == 0, name
        assert c.num_warps in (4, 8) and c.num_stages >= 2, name
        assert (c.block_m >= 128) == (c.num_warps == 8), name  # two warpgroups for 128-row tiles
    for name, c in DW_CONFIGS.items():
        for v in (c.block_m, c.block_k, c.block_n):
            assert v >= 16 and v & (v - 1) == 0, name


def test_interpreter_policy_and_override():
    # the test session runs the interpreter: few, large tiles, row tile from the rows per slot
    assert gemm_config(3, 24, 40, torch.float32) == GemmConfig(16, 32, 64, 8, 4, 1)
    assert gemm_config(500, 300, 300, torch.float32).block_m == 64
    assert row_tile(500, BF16) == 64
    forced = GemmConfig(32, 16, 16, 8, 4, 1)
    with override(gemm=forced, dw=DwConfig(16, 16, 16, 4, 1, split_rows=8)):
        assert gemm_config(5000, 4096, 4096, BF16) is forced and row_tile(5000, BF16) == 32
        assert dw_config(5000, 4096, 4096, BF16).split_rows == 8
    assert gemm_config(5000, 4096, 4096, BF16).block_m == 64
