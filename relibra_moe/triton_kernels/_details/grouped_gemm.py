"""The ``@triton.jit`` kernels of :mod:`relibra_moe.triton_kernels.grouped_gemm` (grouped GEMM with its
epilogues, destination-major dW and its split reduction); launched only by that module's host code.
"""

from __future__ import annotations

import triton
import triton.language as tl

from relibra_moe.triton_kernels.backend import cast_out

__all__ = ["grouped_mm_kernel", "grouped_mm_dw_kernel", "dw_reduce_kernel"]


#: Epilogues of :func:`grouped_mm_kernel`.
EPI_PLAIN, EPI_SWIGLU, EPI_SWIGLU_BWD = 0, 1, 2


@triton.jit
def grouped_mm_kernel(
    x_ptr,  # [R, K] slot-sorted rows (row stride stride_xm, unit column stride)
    w_ptr,  # slot weights: slot s's [K, N'] matrix starts at w_ptr + base(s), strides (stride_wk, stride_wn)
    w_off_ptr,  # [S] int64 element offset base(s) of each slot's matrix from w_ptr (read if INDIRECT)
    offsets_ptr,  # [S + 1] int32 row offsets of the slots
    tile_slot_ptr,  # [B] int32 slot of each tile (-1: zero tile / unused)
    tile_row_ptr,  # [B] int32 first row of each tile (-1: unused)
    out_ptr,  # PLAIN: [R, N] = x W; SWIGLU: a [R, N]; SWIGLU_BWD: dh [R, 2N] (row stride stride_om)
    h_ptr,  # SWIGLU: h [R, 2N] written if STORE_H; SWIGLU_BWD: h [R, 2N] read (row stride stride_hm)
    a_ptr,  # SWIGLU_BWD: a = swiglu(h) [R, N] written (row stride stride_am)
    R,
    N,
    K,
    num_tiles,
    stride_xm,
    stride_ws,
    stride_wk,
    stride_wn,
    stride_om,
    stride_hm,
    stride_am,
    INDIRECT: tl.constexpr,
    W_ALIGNED: tl.constexpr,
    UPCAST: tl.constexpr,
    RNE: tl.constexpr,
    PRECISION: tl.constexpr,
    EVEN_K: tl.constexpr,
    EPILOGUE: tl.constexpr,
    STORE_H: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """Grouped GEMM over the tile schedule: program -> (tile b, N-block n), grouped for L2 reuse.

    A real tile (slot >= 0) computes acc = x[rows, :] @ W_slot[:, n-block] in fp32 over K, with
    rows = [tile_row, min(tile_row + BLOCK_M, offsets[slot + 1])). Epilogue:

    * PLAIN: out = acc.
    * SWIGLU (W_slot is [K, 2N], gate columns first): a second accumulator takes the up columns
      ``N + n-block``; h = [gate | up] is rounded to the output dtype (stored if STORE_H: the
      backward's input), and out = silu(gate) * up from the rounded values, so the backward's
      recomputation of ``a`` gives the same bits.
    * SWIGLU_BWD (acc = da = dY W_down^T): reads h's gate and up blocks, writes
      dh = [da * up * s * (1 + gate * (1 - s)) | da * silu(gate)] (s = sigmoid(gate)) and
      a = silu(gate) * up, so the MLP backward runs no elementwise pass over [R, 2N].

    A zero tile (slot == -1, row >= 0) writes zeros to every output row it covers; unused tiles
    return at once. GROUP_M consecutive tiles (usually of the same slot) sweep the N-blocks together
    so W_slot's column blocks stay in L2.
    """
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    group = GROUP_M * num_pid_n
    first_b = (pid // group) * GROUP_M
    group_size = min(num_tiles - first_b, GROUP_M)
    b = first_b + (pid % group) % group_size
    pid_n = (pid % group) // group_size

    slot = tl.load(tile_slot_ptr + b)
    row0 = tl.load(tile_row_ptr + b)
    if row0 < 0:
        return
    rows = row0 + tl.arange(0, BLOCK_M)
    rows64 = rows.to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    out_ptrs = out_ptr + rows64[:, None] * stride_om + cols[None, :]
    h_ptrs = h_ptr + rows64[:, None] * stride_hm + cols[None, :]
    a_ptrs = a_ptr + rows64[:, None] * stride_am + cols[None, :]
    if slot < 0:
        zmask = (rows < R)[:, None] & cmask[None, :]
        zero = tl.zeros((BLOCK_M, BLOCK_N), dtype=out_ptr.dtype.element_ty)
        tl.store(out_ptrs, zero, mask=zmask)
        if EPILOGUE == 1:
            if STORE_H:
                tl.store(h_ptrs, zero, mask=zmask)
                tl.store(h_ptrs + N, zero, mask=zmask)
        if EPILOGUE == 2:
            tl.store(out_ptrs + N, zero, mask=zmask)
            tl.store(a_ptrs, zero, mask=zmask)
        return
    end = tl.load(offsets_ptr + slot + 1)
    rmask = rows < end
    if INDIRECT:
        w_base = tl.load(w_off_ptr + slot)
        if W_ALIGNED:  # every slot offset is a multiple of 16 elements: lets the loads pipeline (cp.async)
            w_base = tl.multiple_of(w_base, 16)
    else:
        w_base = slot.to(tl.int64) * stride_ws
    ks = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows64[:, None] * stride_xm + ks[None, :]
    w_ptrs = w_ptr + w_base + ks.to(tl.int64)[:, None] * stride_wk + cols.to(tl.int64)[None, :] * stride_wn
    up_shift = N.to(tl.int64) * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(x_ptrs, mask=rmask[:, None], other=0.0)
            w = tl.load(w_ptrs, mask=cmask[None, :], other=0.0)
            if EPILOGUE == 1:
                wu = tl.load(w_ptrs + up_shift, mask=cmask[None, :], other=0.0)
        else:
            kmask = (k0 + ks) < K
            a = tl.load(x_ptrs, mask=rmask[:, None] & kmask[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=kmask[:, None] & cmask[None, :], other=0.0)
            if EPILOGUE == 1:
                wu = tl.load(w_ptrs + up_shift, mask=kmask[:, None] & cmask[None, :], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
        if EPILOGUE == 1:
            if UPCAST:
                wu = wu.to(tl.float32)
            acc_up = tl.dot(a, wu, acc_up, input_precision=PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_wk
    omask = rmask[:, None] & cmask[None, :]
    odt = out_ptr.dtype.element_ty
    if EPILOGUE == 0:
        tl.store(out_ptrs, cast_out(acc, odt, RNE), mask=omask)
    elif EPILOGUE == 1:
        gate = cast_out(acc, odt, RNE)
        up = cast_out(acc_up, odt, RNE)
        if STORE_H:
            tl.store(h_ptrs, gate, mask=omask)
            tl.store(h_ptrs + N, up, mask=omask)
        g = gate.to(tl.float32)
        act = g * tl.sigmoid(g) * up.to(tl.float32)
        tl.store(out_ptrs, cast_out(act, odt, RNE), mask=omask)
    else:
        g = tl.load(h_ptrs, mask=omask, other=0.0).to(tl.float32)
        u = tl.load(h_ptrs + N, mask=omask, other=0.0).to(tl.float32)
        sig = tl.sigmoid(g)
        silu = g * sig
        d_gate = acc * u * sig * (1.0 + g * (1.0 - sig))
        tl.store(out_ptrs, cast_out(d_gate, odt, RNE), mask=omask)
        tl.store(out_ptrs + N, cast_out(acc * silu, odt, RNE), mask=omask)
        tl.store(a_ptrs, cast_out(silu * u, odt, RNE), mask=omask)


@triton.jit
def grouped_mm_dw_kernel(
    x_ptr,  # [R, K] slot-sorted rows (row stride stride_xm, unit column stride)
    dy_ptr,  # [R, N] output gradients in slot order (row stride stride_dm, unit column stride)
    offsets_ptr,  # [S + 1] int32 row offsets of the slots
    order_ptr,  # [D] int32 destinations in program order (most rows first)
    seg_ptr,  # [D + 1] int32 destination d's slots are seg_slot[seg[d] : seg[d + 1]]
    seg_slot_ptr,  # [n] int32 slots sorted by destination (stable: increasing slot inside a destination)
    dest_off_ptr,  # [D] int64 element offset of destination d's [K, N] matrix from dw_ptr
    nsplit_ptr,  # [D] int32 row splits of d (1: not split; > 1: partials into the workspace)
    part_ptr,  # [D] int32 first workspace part of a split destination
    ws_ptr,  # [P, K, N] fp32 contiguous workspace of the split destinations' partial sums
    dw_ptr,  # destination matrices, strides (stride_gk, stride_gn) from dw_ptr + dest_off[d]
    N,
    K,
    stride_xm,
    stride_dm,
    stride_gk,
    stride_gn,
    UPCAST: tl.constexpr,
    RNE: tl.constexpr,
    PRECISION: tl.constexpr,
    SPLIT_MAX: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """dW[d][k-block, n-block] = sum over the slots of destination d, and their rows, of x^T dy.

    Program order is destination-major (``pid -> (destination, split, K-block, N-block)``, the tile
    fastest): the programs resident at one time share one slot's rows, which stay in L2 while every
    output tile of the slot reads them. Destinations run most rows first. A destination is a row of a
    weight source (its gradient is written in place, once, through ``dest_off``); several slots may
    point to it (summed in increasing slot order), none (zeros are written). A hot single-slot
    destination is split into ``nsplit[d]`` row ranges whose fp32 partials go to the workspace and
    are summed in split order by :func:`dw_reduce_kernel`: deterministic, no atomics.
    """
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    tiles = tl.cdiv(K, BLOCK_K) * num_pid_n
    unit = pid // tiles
    t = pid % tiles
    d = tl.load(order_ptr + unit // SPLIT_MAX)
    j = unit % SPLIT_MAX
    n_split = tl.load(nsplit_ptr + d)
    if j >= n_split:
        return
    pid_k = t // num_pid_n
    pid_n = t % num_pid_n
    ks = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    ns = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    kmask = ks < K
    nmask = ns < N
    acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    seg0 = tl.load(seg_ptr + d)
    seg1 = tl.load(seg_ptr + d + 1)
    for i in range(seg0, seg1):
        slot = tl.load(seg_slot_ptr + i)
        start = tl.load(offsets_ptr + slot)
        end = tl.load(offsets_ptr + slot + 1)
        if n_split > 1:  # split destinations have one slot: rows [start + j * chunk, ...)
            chunk = tl.cdiv(tl.cdiv(end - start, n_split), BLOCK_M) * BLOCK_M
            start = start + j * chunk
            end = tl.minimum(end, start + chunk)
        for m0 in range(start, end, BLOCK_M):
            rows = m0 + tl.arange(0, BLOCK_M)
            rmask = rows < end
            rows64 = rows.to(tl.int64)
            xt = tl.load(x_ptr + rows64[None, :] * stride_xm + ks[:, None], mask=kmask[:, None] & rmask[None, :],
                         other=0.0)  # fmt: skip
            g = tl.load(dy_ptr + rows64[:, None] * stride_dm + ns[None, :], mask=rmask[:, None] & nmask[None, :],
                        other=0.0)  # fmt: skip
            if UPCAST:
                xt = xt.to(tl.float32)
                g = g.to(tl.float32)
            acc = tl.dot(xt, g, acc, input_precision=PRECISION)
    tmask = kmask[:, None] & nmask[None, :]
    if n_split > 1:
        p = (tl.load(part_ptr + d) + j).to(tl.int64)
        tl.store(ws_ptr + p * K * N + ks.to(tl.int64)[:, None] * N + ns[None, :], acc, mask=tmask)
    else:
        base = tl.load(dest_off_ptr + d)
        dw_ptrs = dw_ptr + base + ks.to(tl.int64)[:, None] * stride_gk + ns.to(tl.int64)[None, :] * stride_gn
        tl.store(dw_ptrs, cast_out(acc, dw_ptr.dtype.element_ty, RNE), mask=tmask)


@triton.jit
def dw_reduce_kernel(
    hot_ptr,  # [H] int32 split destinations (-1: unused entry)
    nsplit_ptr,  # [D] int32 row splits of each destination
    part_ptr,  # [D] int32 first workspace part of each split destination
    dest_off_ptr,  # [D] int64 element offset of destination d's matrix from dw_ptr
    ws_ptr,  # [P, K, N] fp32 partial sums
    dw_ptr,
    N,
    K,
    stride_gk,
    stride_gn,
    RNE: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """dW[d] = sum of the split partials of destination d in split order (fp32), rounded once (an
    elementwise pass over the hot destinations only, with its own small tile)."""
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    tiles = tl.cdiv(K, BLOCK_K) * num_pid_n
    d = tl.load(hot_ptr + pid // tiles)
    if d < 0:
        return
    t = pid % tiles
    ks = (t // num_pid_n) * BLOCK_K + tl.arange(0, BLOCK_K)
    ns = (t % num_pid_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    tmask = (ks < K)[:, None] & (ns < N)[None, :]
    p0 = tl.load(part_ptr + d).to(tl.int64)
    tile = ks.to(tl.int64)[:, None] * N + ns[None, :]
    acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    for j in range(0, tl.load(nsplit_ptr + d)):
        acc += tl.load(ws_ptr + (p0 + j) * K * N + tile, mask=tmask, other=0.0)
    base = tl.load(dest_off_ptr + d)
    dw_ptrs = dw_ptr + base + ks.to(tl.int64)[:, None] * stride_gk + ns.to(tl.int64)[None, :] * stride_gn
    tl.store(dw_ptrs, cast_out(acc, dw_ptr.dtype.element_ty, RNE), mask=tmask)
