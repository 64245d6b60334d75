"""The ``@triton.jit`` kernels of :mod:`relibra_moe.triton_kernels.permute` (gather into slot order, weighted
combine back to tokens, per-pair row dot products); launched only by that module's host code.
"""

from __future__ import annotations

import triton
import triton.language as tl

from relibra_moe.triton_kernels.backend import cast_out

__all__ = ["permute_kernel", "combine_kernel", "rowdot_kernel"]


@triton.jit
def permute_kernel(
    x_ptr,  # [T, H] token rows (row stride stride_x, unit column stride)
    gather_ptr,  # [R] int32, sorted row -> flat pair t * k + j (-1: padding row)
    scale_ptr,  # [T * k] per-pair scale (read only if HAS_SCALE)
    out_ptr,  # [R, H] sorted rows (row stride stride_o)
    R,
    H,
    stride_x,
    stride_o,
    TOP_K: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    RNE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """Gather: program (i, h) writes rows [i*BLOCK_R, +BLOCK_R) x columns [h*BLOCK_H, +BLOCK_H) of out.

    out[r] = x[pair // k] * scale[pair] with pair = gather[r]; padding rows are written as zeros, so
    the output needs no memset.
    """
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    rmask = rows < R
    cmask = cols < H
    pair = tl.load(gather_ptr + rows, mask=rmask, other=-1)
    valid = pair >= 0
    tok = tl.where(valid, pair // TOP_K, 0).to(tl.int64)
    v = tl.load(x_ptr + tok[:, None] * stride_x + cols[None, :], mask=valid[:, None] & cmask[None, :], other=0.0)
    if HAS_SCALE:
        sc = tl.load(scale_ptr + pair, mask=valid, other=0.0).to(tl.float32)
        v = v.to(tl.float32) * sc[:, None]
    out_offs = rows.to(tl.int64)[:, None] * stride_o + cols[None, :]
    tl.store(out_ptr + out_offs, cast_out(v, out_ptr.dtype.element_ty, RNE), mask=rmask[:, None] & cmask[None, :])


@triton.jit
def combine_kernel(
    y_ptr,  # [R, H] expert outputs in slot order (row stride stride_y)
    scatter_ptr,  # [T * k] int32, flat pair -> sorted row (-1: not routed)
    w_ptr,  # [T * k] routing weights (any float dtype, read in fp32)
    out_ptr,  # [T, H] combined tokens (row stride stride_o)
    T,
    H,
    stride_y,
    stride_o,
    TOP_K: tl.constexpr,
    RNE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """Weighted sum without atomics: program (i, h) owns tokens [i*BLOCK_T, +BLOCK_T) x one column block.

    acc = sum_{j=0..k-1} w[t, j] * y[scatter[t*k+j]] in fp32, in increasing j (deterministic).
    """
    toks = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    tmask = toks < T
    cmask = cols < H
    acc = tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        row = tl.load(scatter_ptr + toks * TOP_K + j, mask=tmask, other=-1)
        valid = row >= 0
        w = tl.load(w_ptr + toks * TOP_K + j, mask=valid, other=0.0).to(tl.float32)
        offs = tl.where(valid, row, 0).to(tl.int64)[:, None] * stride_y + cols[None, :]
        v = tl.load(y_ptr + offs, mask=valid[:, None] & cmask[None, :], other=0.0)
        acc += v.to(tl.float32) * w[:, None]
    out_offs = toks.to(tl.int64)[:, None] * stride_o + cols[None, :]
    tl.store(out_ptr + out_offs, cast_out(acc, out_ptr.dtype.element_ty, RNE), mask=tmask[:, None] & cmask[None, :])


@triton.jit
def rowdot_kernel(
    a_ptr,  # [T, H] token rows (row stride stride_a)
    b_ptr,  # [R, H] sorted rows (row stride stride_b)
    scatter_ptr,  # [T * k] int32, flat pair -> sorted row (-1: not routed)
    out_ptr,  # [T * k] fp32 row dots
    T,
    H,
    stride_a,
    stride_b,
    TOP_K: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """Routing-weight gradient: out[t, j] = <a[t], b[scatter[t*k+j]]> in fp32 (0 if not routed).

    One program per block of tokens, looping over H in BLOCK_H chunks (deterministic order).
    """
    toks = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = toks < T
    a_rows = toks.to(tl.int64)[:, None] * stride_a
    for j in tl.static_range(TOP_K):
        row = tl.load(scatter_ptr + toks * TOP_K + j, mask=tmask, other=-1)
        valid = row >= 0
        b_rows = tl.where(valid, row, 0).to(tl.int64)[:, None] * stride_b
        acc = tl.zeros((BLOCK_T,), dtype=tl.float32)
        for h0 in range(0, H, BLOCK_H):
            cols = h0 + tl.arange(0, BLOCK_H)
            m = valid[:, None] & (cols < H)[None, :]
            va = tl.load(a_ptr + a_rows + cols[None, :], mask=m, other=0.0).to(tl.float32)
            vb = tl.load(b_ptr + b_rows + cols[None, :], mask=m, other=0.0).to(tl.float32)
            acc += tl.sum(va * vb, axis=1)
        tl.store(out_ptr + toks * TOP_K + j, acc.to(out_ptr.dtype.element_ty), mask=tmask)
