"""The ``@triton.jit`` kernels of :mod:`relibra_moe.triton_kernels.replica_copy` (persistent row copy into
replica slots and the add-back of slot gradients into home rows); launched only by that module's host code.
"""

from __future__ import annotations

import triton
import triton.language as tl

from relibra_moe.triton_kernels.backend import cast_out

__all__ = ["copy_rows_kernel", "add_rows_kernel", "add_long_runs_kernel"]


@triton.jit
def copy_rows_kernel(
    src_ptr,  # [E, D] source rows (row stride stride_src; each row a dense block of D elements)
    src_idx_ptr,  # [n] int source row of pair i (-1: skip)
    dst_ptr,  # [S, D] destination rows (row stride stride_dst; same in-row memory order as src)
    dst_idx_ptr,  # [n] int destination row of pair i (-1: skip)
    D,
    stride_src,
    stride_dst,
    num_items,
    chunks_per_row,
    NUM_PROGRAMS: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Persistent row copy: program p handles work items p, p + P, ... of (pair i, chunk c).

    dst[dst_idx[i]][c*BLOCK : (c+1)*BLOCK] = src[src_idx[i]][same range]. The memory order inside a
    row is the tensors' own (rows are dense blocks), so a transposed HF parameter copies as is.
    """
    pid = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    # Straight-line body (skips are folded into the mask) so the loop can be software-pipelined:
    # the next chunk's load is in flight while this one is stored.
    for item in tl.range(pid, num_items, NUM_PROGRAMS, num_stages=NUM_STAGES):
        i = item // chunks_per_row
        c = item % chunks_per_row
        si = tl.load(src_idx_ptr + i).to(tl.int64)
        di = tl.load(dst_idx_ptr + i).to(tl.int64)
        e = c * BLOCK + offs
        m = e < tl.where((si >= 0) & (di >= 0), D, 0)
        v = tl.load(src_ptr + si * stride_src + e, mask=m)
        tl.store(dst_ptr + di * stride_dst + e, v, mask=m)


@triton.jit
def add_rows_kernel(
    slot_ptr,  # [S, D] slot gradients (row stride stride_slot)
    slot_idx_ptr,  # [n] int32 slot row of the i-th pair after sorting by home row
    home_ptr,  # [E, D] home gradients, accumulated into (row stride stride_home)
    home_idx_ptr,  # [n] int32 home row of the i-th sorted pair (-1: skip)
    run_ptr,  # [n] int32 length of the run of equal home rows starting at i (0 if i is not a run head)
    D,
    stride_slot,
    stride_home,
    num_items,
    chunks_per_row,
    num_pairs,
    NUM_PROGRAMS: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    RUN: tl.constexpr,
    RNE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Persistent, pipelined deterministic add-back of the runs of at most RUN pairs.

    Program p handles work items p, p + P, ... of (sorted pair i, chunk c). Pairs are sorted (stably)
    by home row on the host side of the launch; only the head of a run of equal home rows does work,
    so no two programs write the same home row and the sum order is fixed (the existing home value,
    then the run's slots in increasing original index, in fp32, rounded once). The body is straight
    line (the run's RUN slot loads are unrolled, skips folded into masks) so the loop is
    software-pipelined like the forward copy: the next item's loads are in flight while this one is
    summed and stored. Longer runs are left to :func:`add_long_runs_kernel`.
    """
    pid = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    for item in tl.range(pid, num_items, NUM_PROGRAMS, num_stages=NUM_STAGES):
        i = item // chunks_per_row
        c = item % chunks_per_row
        h = tl.load(home_idx_ptr + i).to(tl.int64)
        run = tl.load(run_ptr + i)
        e = c * BLOCK + offs
        live = (h >= 0) & (run > 0) & (run <= RUN)
        m = e < tl.where(live, D, 0)
        hp = home_ptr + h * stride_home + e
        acc = tl.load(hp, mask=m, other=0.0).to(tl.float32)
        for q in tl.static_range(RUN):
            s = tl.load(slot_idx_ptr + tl.minimum(i + q, num_pairs - 1)).to(tl.int64)  # unused past the run
            acc += tl.load(slot_ptr + s * stride_slot + e, mask=e < tl.where(live & (run > q), D, 0),
                           other=0.0).to(tl.float32)  # fmt: skip
        tl.store(hp, cast_out(acc, home_ptr.dtype.element_ty, RNE), mask=m)


@triton.jit
def add_long_runs_kernel(
    slot_ptr,
    slot_idx_ptr,
    home_ptr,
    home_idx_ptr,
    run_ptr,
    D,
    stride_slot,
    stride_home,
    num_items,
    chunks_per_row,
    NUM_PROGRAMS: tl.constexpr,
    RUN: tl.constexpr,
    RNE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """The runs longer than RUN (arguments as :func:`add_rows_kernel`): a loop over the run's slots,
    same sum order. Launched only when a run that long can exist (more than RUN pairs)."""
    pid = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    for item in range(pid, num_items, NUM_PROGRAMS):
        i = item // chunks_per_row
        c = item % chunks_per_row
        h = tl.load(home_idx_ptr + i).to(tl.int64)
        run = tl.load(run_ptr + i)
        if (h >= 0) & (run > RUN):
            e = c * BLOCK + offs
            m = e < D
            hp = home_ptr + h * stride_home + e
            acc = tl.load(hp, mask=m, other=0.0).to(tl.float32)
            for j in range(i, i + run):
                s = tl.load(slot_idx_ptr + j).to(tl.int64)
                acc += tl.load(slot_ptr + s * stride_slot + e, mask=m, other=0.0).to(tl.float32)
            tl.store(hp, cast_out(acc, home_ptr.dtype.element_ty, RNE), mask=m)
