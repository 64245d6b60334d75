"""Tile configs of the grouped GEMMs, chosen from the shapes (no autotuning).

One small function per kernel maps (rows per slot, N, K, dtype) to an entry of a fixed table:

* :func:`gemm_config` for the forward / dX grouped GEMM (``[R, K] x W_s [K, N]``), including its
  SwiGLU-epilogue variants (``gated``: the program holds a gate and an up accumulator of
  ``block_n / 2`` columns each, so the register and shared-memory footprint is the table entry's);
* :func:`dw_config` for the weight gradient (``dW_s = X_s^T dY_s``, output tile ``block_k x block_n``,
  ``block_m`` rows per step).

Rows per slot is the host-known mean ``R / S`` (no host sync on the per-slot counts). Large
per-slot row counts get Hopper-sized tiles (128 x 256 x 64 on two warpgroups, as CUTLASS's sm90
grouped GEMM); small ones keep small row tiles so a slot with a handful of rows does not pay for
a 128-row tile. Every compiled entry is built for sm_90 by ``tests/e2e/test_kernels_sm90.py``, which
fails on register spills and on shared memory over the 227 KB per-block limit.

In the CPU interpreter (``TRITON_INTERPRET=1``) the cost grows with the number of programs, not the
tile size, so the interpreter gets few, large tiles. :func:`override` forces one config (tests
exercise multi-tile paths with it; benchmarks compare configs).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch

from relibra_moe.triton_kernels.backend import INTERPRET

__all__ = [
    "DW_CONFIGS",
    "GEMM_CONFIGS",
    "DwConfig",
    "GemmConfig",
    "dw_config",
    "gemm_config",
    "override",
    "row_tile",
    "table_dw_config",
    "table_gemm_config",
]


@dataclass(frozen=True)
class GemmConfig:
    """Tile config of the forward / dX grouped GEMM.

    Attributes:
        block_m: rows per tile (the GEMM's row tile; the routing metadata's block is independent).
        block_n: output columns per tile (gated: gate + up columns together).
        block_k: reduction step.
        group_m: consecutive row tiles that sweep the N-blocks together (L2 reuse of W_s).
        num_warps: warps per program (8 = two Hopper warpgroups).
        num_stages: software-pipeline depth of the K loop.
        swiglu_bwd: whether the SwiGLU-backward epilogue may run on this entry (it holds the h gate
            and up tiles next to the accumulator; the widest entry would spill registers).
    """

    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int
    swiglu_bwd: bool = True


@dataclass(frozen=True)
class DwConfig:
    """Tile config of the weight-gradient kernel: a ``block_k x block_n`` tile of ``dW_s``, walking the
    slot's rows ``block_m`` at a time.

    ``split_rows``: a slot with more rows is split over rows (deterministic fp32 reduction of the
    parts); 0 = automatic, ``max(4 * block_m, R * tiles_per_slot / SMs)``, i.e. split a slot whose
    serial walk would outlast the average program of a balanced wave.
    """

    block_m: int
    block_k: int
    block_n: int
    num_warps: int
    num_stages: int
    split_rows: int = 0


#: Forward / dX configs for compiled kernels, by name (the sm_90 test compiles every entry).
GEMM_CONFIGS: dict[str, GemmConfig] = {
    # fp16 / bf16
    "m128_n256": GemmConfig(128, 256, 64, 8, 8, 3, swiglu_bwd=False),  # large slots, wide N: 2 warpgroups
    "m128_n128": GemmConfig(128, 128, 64, 8, 8, 4),  # large slots, narrow N
    "m64_n128": GemmConfig(64, 128, 64, 8, 4, 4),  # medium slots: one warpgroup
    "m32_n128": GemmConfig(32, 128, 64, 8, 4, 4),  # small slots (mma.sync, no 64-row wgmma waste)
    "m16_n128": GemmConfig(16, 128, 128, 8, 4, 3),  # decode-sized slots
    # fp32 (tf32 or ieee)
    "f32_m128_n128": GemmConfig(128, 128, 32, 8, 8, 3),
    "f32_m64_n128": GemmConfig(64, 128, 32, 8, 4, 3),
    "f32_m16_n64": GemmConfig(16, 64, 32, 8, 4, 3),
}

#: Weight-gradient configs for compiled kernels, by name.
DW_CONFIGS: dict[str, DwConfig] = {
    "k128_n256": DwConfig(64, 128, 256, 8, 3),  # large slots: 144 KB smem, 128 fp32 acc regs / thread
    "k128_n128": DwConfig(64, 128, 128, 8, 3),
    "k64_n64": DwConfig(32, 64, 64, 4, 3),  # small K x N or few rows
    "f32_k128_n128": DwConfig(32, 128, 128, 8, 3),
    "f32_k64_n64": DwConfig(32, 64, 64, 4, 3),
}

_local = threading.local()


def _pow2(n: int, lo: int, hi: int) -> int:
    p = 1
    while p < max(n, 1):
        p *= 2
    return max(lo, min(hi, p))


@contextlib.contextmanager
def override(gemm: GemmConfig | None = None, dw: DwConfig | None = None) -> Iterator[None]:
    """Use ``gemm`` / ``dw`` for every grouped GEMM launched by this thread inside the block (tests,
    benchmarks). Block sizes must be powers of two (the forward's ``block_m >= 16``)."""
    prev = getattr(_local, "cfg", (None, None))
    _local.cfg = (gemm, dw)
    try:
        yield
    finally:
        _local.cfg = prev


def gemm_config(rows_per_slot: float, n: int, k: int, dtype: torch.dtype, *, gated: bool = False,
                swiglu_bwd: bool = False) -> GemmConfig:
    """The forward / dX tile config for mean ``rows_per_slot`` rows per slot, N output columns (gated:
    the width of the gate+up pair, 2I), reduction depth K, operand ``dtype``; ``swiglu_bwd``: for
    the SwiGLU-backward epilogue (only entries with ``swiglu_bwd=True``)."""
    forced = getattr(_local, "cfg", (None, None))[0]
    if forced is not None:
        return forced
    if INTERPRET:
        bm = _pow2(int(rows_per_slot), 16, 64)
        bn = _pow2(n, 32 if gated else 16, 128)
        return GemmConfig(bm, bn, _pow2(k, 16, 128), 8, 4, 1)
    return table_gemm_config(rows_per_slot, n, k, dtype, gated=gated, swiglu_bwd=swiglu_bwd)


def table_gemm_config(rows_per_slot: float, n: int, k: int, dtype: torch.dtype, *, gated: bool = False,
                      swiglu_bwd: bool = False) -> GemmConfig:
    """The compiled-kernel choice of :func:`gemm_config` (a :data:`GEMM_CONFIGS` entry, with N / K
    tiles narrowed to the problem when it is smaller than the entry's tile)."""
    if dtype == torch.float32:
        if rows_per_slot >= 128:
            cfg = GEMM_CONFIGS["f32_m128_n128"]
        elif rows_per_slot > 16:
            cfg = GEMM_CONFIGS["f32_m64_n128"]
        else:
            cfg = GEMM_CONFIGS["f32_m16_n64"]
    elif rows_per_slot >= 128:
        cfg = GEMM_CONFIGS["m128_n256" if n >= 256 and not swiglu_bwd else "m128_n128"]
    elif rows_per_slot > 32:
        cfg = GEMM_CONFIGS["m64_n128"]
    elif rows_per_slot > 16:
        cfg = GEMM_CONFIGS["m32_n128"]
    else:
        cfg = GEMM_CONFIGS["m16_n128"]
    # Narrow problems: don't sweep mostly-masked columns / reduction steps.
    bn = min(cfg.block_n, _pow2(n, 32 if gated else 16, cfg.block_n))
    bk = min(cfg.block_k, _pow2(k, 16, cfg.block_k))
    return replace(cfg, block_n=bn, block_k=bk) if (bn, bk) != (cfg.block_n, cfg.block_k) else cfg


def dw_config(rows_per_slot: float, k: int, n: int, dtype: torch.dtype) -> DwConfig:
    """The weight-gradient tile config for mean ``rows_per_slot`` rows per slot and a ``[K, N]`` weight."""
    forced = getattr(_local, "cfg", (None, None))[1]
    if forced is not None:
        return forced
    if INTERPRET:
        return DwConfig(64, _pow2(k, 16, 128), _pow2(n, 16, 128), 4, 1)
    return table_dw_config(rows_per_slot, k, n, dtype)


def table_dw_config(rows_per_slot: float, k: int, n: int, dtype: torch.dtype) -> DwConfig:
    """The compiled-kernel choice of :func:`dw_config` (a :data:`DW_CONFIGS` entry, tiles narrowed to
    the problem)."""
    if dtype == torch.float32:
        cfg = DW_CONFIGS["f32_k128_n128" if rows_per_slot >= 64 and k >= 128 and n >= 128 else "f32_k64_n64"]
    elif rows_per_slot >= 128 and k >= 128 and n >= 256:
        cfg = DW_CONFIGS["k128_n256"]
    elif rows_per_slot >= 64 and k >= 128 and n >= 128:
        cfg = DW_CONFIGS["k128_n128"]
    else:
        cfg = DW_CONFIGS["k64_n64"]
    bk = min(cfg.block_k, _pow2(k, 16, cfg.block_k))
    bn = min(cfg.block_n, _pow2(n, 16, cfg.block_n))
    return replace(cfg, block_k=bk, block_n=bn) if (bk, bn) != (cfg.block_k, cfg.block_n) else cfg


def row_tile(rows_per_slot: float, dtype: torch.dtype) -> int:
    """The grouped GEMMs' row tile for mean ``rows_per_slot`` rows per slot (it depends on rows and dtype
    only), as a routing block that lets them reuse the routing metadata's tile schedule."""
    return gemm_config(rows_per_slot, 256, 256, dtype).block_m
