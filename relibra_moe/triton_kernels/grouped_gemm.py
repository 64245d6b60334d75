"""Grouped GEMM over slot-sorted rows: forward, dX and dW, plus a SwiGLU expert MLP built from them.

``grouped_mm(x_sorted [R, K], w, meta) -> [R, N]``: sorted row r of slot s is multiplied by ``W_s``
[K, N]. Rows are unpadded: a tile of the schedule (``meta.tile_slot``, ``meta.tile_row``) holds up to
``block_m`` rows of one slot; padding rows (after the routed pairs) come out as zeros.

Weights ``w`` are either

* a tensor [S, K, N] with any strides, so a Hugging Face parameter stored as [E, N, K] is passed as
  ``param.transpose(1, 2)`` without a copy; or
* an :class:`ExpertWeights` indirection: slot s uses ``sources[slot_source[s]][slot_index[s]]``, e.g.
  the home experts' parameter and the replica slots of the layer-shared buffer, never concatenated.

Both are differentiable w.r.t. ``x_sorted`` and every weight tensor; gradients land in the source
rows the slots point to (a home expert and its replica slots on the same rank sum deterministically).

Backward: ``dX = grouped_mm(dY, W^T)`` (the same kernel on the transposed view) and
``dW_s = X_s^T dY_s`` (:func:`grouped_mm_dw`: one program per (slot, K-tile, N-tile) looping over
the slot's rows in order; deterministic, no atomics).

Expert MLP: :func:`swiglu_experts` is an autograd Function over these ops that saves only x and
h = x W_gate_up and recomputes the activation in backward (closed-form SwiGLU backward, or autograd on
any other activation, e.g. GPT-OSS's clamped interleaved one).

Precision: fp32 accumulation; fp16 / bf16 use tensor cores, fp32 follows
``torch.backends.cuda.matmul.allow_tf32``. Configs are heuristics per (BLOCK_M, N, K, dtype), no
autotuning. ExpertWeights addresses every source from sources[0]'s pointer plus a per-slot element
offset (cached per pointer set, so steady-state calls do no host-to-device copy).

Each op is a ``torch.library.custom_op`` (namespace ``relibra``) with a fake implementation, so
``torch.compile`` graphs can contain it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from relibra_moe.triton_kernels.backend import (
    INTERPRET,
    bf16_rne,
    cast_out,
    dot_upcast,
    keep_backend,
    remember_backend,
    use_triton,
)
from relibra_moe.triton_kernels.heuristics import dw_config, gemm_config
from relibra_moe.triton_kernels.replica_copy import _add_op
from relibra_moe.triton_kernels.routing import RoutingMeta, tile_schedule

__all__ = [
    "ExpertWeights",
    "grouped_mm",
    "grouped_mm_dw",
    "grouped_mm_dw_torch",
    "grouped_mm_dx",
    "grouped_mm_torch",
    "swiglu",
    "swiglu_backward",
    "swiglu_experts",
]


@dataclass(frozen=True, eq=False)
class ExpertWeights:
    """Per-slot expert weights drawn from several source tensors without concatenating them.

    Attributes:
        sources: tensors [E_i, K, N] (same dtype, device, K and N, and the same strides of the K and
            N dims, e.g. all row-major or all ``param.transpose(1, 2)`` views).
        slot_source: int64 [S], which source each slot reads.
        slot_index: int64 [S], which row of that source each slot reads.
    """

    sources: tuple[torch.Tensor, ...]
    slot_source: torch.Tensor
    slot_index: torch.Tensor

    def __post_init__(self) -> None:
        if not self.sources:
            raise ValueError("ExpertWeights.sources is empty")
        object.__setattr__(self, "sources", tuple(self.sources))
        s0 = self.sources[0]
        for i, s in enumerate(self.sources):
            if s.dim() != 3:
                raise ValueError(f"ExpertWeights.sources[{i}] must be [E, K, N], got shape {tuple(s.shape)}")
            if s.shape[1:] != s0.shape[1:] or s.dtype != s0.dtype or s.device != s0.device:
                raise ValueError(
                    f"ExpertWeights.sources[{i}] is {tuple(s.shape)} {s.dtype} on {s.device}; "
                    f"sources[0] is {tuple(s0.shape)} {s0.dtype} on {s0.device}"
                )
            if s.stride()[1:] != s0.stride()[1:] and s.shape[0] > 0 and s0.shape[0] > 0:
                raise ValueError(
                    f"ExpertWeights.sources[{i}] has K/N strides {s.stride()[1:]}, sources[0] has "
                    f"{s0.stride()[1:]}: allocate the sources in the same layout"
                )
        if self.slot_source.dim() != 1 or self.slot_index.shape != self.slot_source.shape:
            raise ValueError(
                f"slot_source {tuple(self.slot_source.shape)} and slot_index {tuple(self.slot_index.shape)} "
                "must be 1-D of equal length"
            )
        if not self.slot_source.is_cuda and self.slot_source.numel() and not torch.compiler.is_compiling():
            src = self.slot_source.long()
            if int(src.min()) < 0 or int(src.max()) >= len(self.sources):
                raise ValueError(f"slot_source must lie in [0, {len(self.sources)}), got {self.slot_source.tolist()}")
            sizes = torch.tensor([s.shape[0] for s in self.sources])[src]
            idx = self.slot_index.long()
            if bool(((idx < 0) | (idx >= sizes)).any()):
                raise ValueError(f"slot_index out of range of its source rows: {self.slot_index.tolist()}")

    @property
    def num_slots(self) -> int:
        return int(self.slot_source.shape[0])

    @property
    def shape(self) -> tuple[int, int, int]:
        """(S, K, N)."""
        return (self.num_slots, int(self.sources[0].shape[1]), int(self.sources[0].shape[2]))

    @property
    def dtype(self) -> torch.dtype:
        return self.sources[0].dtype

    @property
    def device(self) -> torch.device:
        return self.sources[0].device

    def transpose(self) -> ExpertWeights:
        """The same slots with every matrix transposed ([E_i, N, K] views, no copy)."""
        return ExpertWeights(tuple(s.transpose(1, 2) for s in self.sources), self.slot_source, self.slot_index)

    def materialize(self) -> torch.Tensor:
        """[S, K, N], a copy (for references and tests; the kernels never build it)."""
        src, idx = self.slot_source.tolist(), self.slot_index.tolist()
        if not src:
            return self.sources[0].new_empty(0, *self.shape[1:])
        return torch.stack([self.sources[a][b] for a, b in zip(src, idx, strict=True)])


def _as_sources(w: torch.Tensor | ExpertWeights) -> tuple[list[torch.Tensor], torch.Tensor | None, torch.Tensor | None]:
    if isinstance(w, ExpertWeights):
        return list(w.sources), w.slot_source, w.slot_index
    if not isinstance(w, torch.Tensor) or w.dim() != 3:
        raise ValueError(f"w must be a [S, K, N] tensor or ExpertWeights, got {type(w).__name__}")
    return [w], None, None


def _slot_matrices(
    sources: list[torch.Tensor], slot_source: torch.Tensor | None, slot_index: torch.Tensor | None, num_slots: int
) -> list[torch.Tensor]:
    if slot_source is None:
        return [sources[0][s] for s in range(num_slots)]
    return [sources[a][b] for a, b in zip(slot_source.tolist(), slot_index.tolist(), strict=True)]


# --------------------------------------------------------------------------------------------------
# torch references (loop over slots; host reads of the offsets are fine here)
# --------------------------------------------------------------------------------------------------


def grouped_mm_torch(
    x: torch.Tensor,
    sources: list[torch.Tensor],
    slot_source: torch.Tensor | None,
    slot_index: torch.Tensor | None,
    offsets: torch.Tensor,
) -> torch.Tensor:
    """Reference of :func:`grouped_mm`: x [R, K] -> [R, N]; rows past ``offsets[-1]`` are zero."""
    off = offsets.tolist()
    mats = _slot_matrices(sources, slot_source, slot_index, len(off) - 1)
    out = x.new_zeros(x.shape[0], sources[0].shape[2])
    upcast = x.dtype in (torch.float16, torch.bfloat16)  # fp32 accumulation, one rounding (as the kernel)
    for s, w in enumerate(mats):
        a, b = off[s], off[s + 1]
        if b > a:
            out[a:b] = (x[a:b].float() @ w.float()).to(x.dtype) if upcast else x[a:b] @ w
    return out


def grouped_mm_dw_torch(x: torch.Tensor, dy: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Reference of :func:`grouped_mm_dw`: x [R, K], dy [R, N] -> [S, K, N], ``X_s^T dY_s`` (fp32 sum)."""
    off = offsets.tolist()
    S = len(off) - 1
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    out = torch.zeros(S, x.shape[1], dy.shape[1], dtype=acc, device=x.device)
    for s in range(S):
        a, b = off[s], off[s + 1]
        if b > a:
            out[s] = x[a:b].to(acc).T @ dy[a:b].to(acc)
    return out.to(x.dtype)


# --------------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------------


@triton.jit
def _grouped_mm_kernel(
    x_ptr,  # [R, K] slot-sorted rows (row stride stride_xm, unit column stride)
    w_ptr,  # slot weights: slot s's [K, N] matrix starts at w_ptr + base(s), strides (stride_wk, stride_wn)
    w_off_ptr,  # [S] int64 element offset base(s) of each slot's matrix from w_ptr (read if INDIRECT)
    offsets_ptr,  # [S + 1] int32 row offsets of the slots
    tile_slot_ptr,  # [B] int32 slot of each tile (-1: zero tile / unused)
    tile_row_ptr,  # [B] int32 first row of each tile (-1: unused)
    out_ptr,  # [R, N] output rows (row stride stride_om, unit column stride)
    R,
    N,
    K,
    num_tiles,
    stride_xm,
    stride_ws,
    stride_wk,
    stride_wn,
    stride_om,
    INDIRECT: tl.constexpr,
    W_ALIGNED: tl.constexpr,
    UPCAST: tl.constexpr,
    RNE: tl.constexpr,
    PRECISION: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """Grouped GEMM over the tile schedule: program -> (tile b, N-block n), grouped for L2 reuse.

    A real tile (slot >= 0) computes out[rows, n-block] = x[rows, :] @ W_slot[:, n-block] with
    rows = [tile_row, min(tile_row + BLOCK_M, offsets[slot + 1])), accumulating in fp32 over K.
    A zero tile (slot == -1, row >= 0) writes zeros to the padding rows it covers; unused tiles
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
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
    if slot < 0:
        tl.store(out_ptrs, tl.zeros((BLOCK_M, BLOCK_N), dtype=out_ptr.dtype.element_ty),
                 mask=(rows < R)[:, None] & cmask[None, :])  # fmt: skip
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
    x_ptrs = x_ptr + rows.to(tl.int64)[:, None] * stride_xm + ks[None, :]
    w_ptrs = w_ptr + w_base + ks.to(tl.int64)[:, None] * stride_wk + cols.to(tl.int64)[None, :] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(x_ptrs, mask=rmask[:, None], other=0.0)
            w = tl.load(w_ptrs, mask=cmask[None, :], other=0.0)
        else:
            kmask = (k0 + ks) < K
            a = tl.load(x_ptrs, mask=rmask[:, None] & kmask[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=kmask[:, None] & cmask[None, :], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_wk
    tl.store(out_ptrs, cast_out(acc, out_ptr.dtype.element_ty, RNE), mask=rmask[:, None] & cmask[None, :])


@triton.jit
def _grouped_mm_dw_kernel(
    x_ptr,  # [R, K] slot-sorted rows (row stride stride_xm, unit column stride)
    dy_ptr,  # [R, N] output gradients in slot order (row stride stride_dm, unit column stride)
    offsets_ptr,  # [S + 1] int32 row offsets of the slots
    dw_ptr,  # [S, K, N] weight gradients, strides (stride_gs, stride_gk, stride_gn)
    N,
    K,
    stride_xm,
    stride_dm,
    stride_gs,
    stride_gk,
    stride_gn,
    UPCAST: tl.constexpr,
    RNE: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """dW_s[k-block, n-block] = sum over the slot's rows of x[rows, k-block]^T @ dy[rows, n-block].

    One program per (slot, K-block, N-block), grid axis 0 = slot; the program walks the slot's rows
    in order, BLOCK_M at a time, accumulating in fp32: deterministic, no atomics. Empty slots store
    zeros.
    """
    slot = tl.program_id(0)
    pid = tl.program_id(1)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid_k = pid // num_pid_n
    pid_n = pid % num_pid_n
    start = tl.load(offsets_ptr + slot)
    end = tl.load(offsets_ptr + slot + 1)
    ks = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    ns = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    kmask = ks < K
    nmask = ns < N
    acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    for m0 in range(start, end, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        rmask = rows < end
        rows64 = rows.to(tl.int64)
        xt = tl.load(x_ptr + rows64[None, :] * stride_xm + ks[:, None], mask=kmask[:, None] & rmask[None, :], other=0.0)
        g = tl.load(dy_ptr + rows64[:, None] * stride_dm + ns[None, :], mask=rmask[:, None] & nmask[None, :], other=0.0)
        if UPCAST:
            xt = xt.to(tl.float32)
            g = g.to(tl.float32)
        acc = tl.dot(xt, g, acc, input_precision=PRECISION)
    dw_ptrs = dw_ptr + slot.to(tl.int64) * stride_gs + ks.to(tl.int64)[:, None] * stride_gk + ns[None, :] * stride_gn
    tl.store(dw_ptrs, cast_out(acc, dw_ptr.dtype.element_ty, RNE), mask=kmask[:, None] & nmask[None, :])


def _precision(dtype: torch.dtype) -> str | None:
    """tl.dot input precision: fp32 follows torch's TF32 switch for matmuls; None (Triton's default,
    tensor cores) for fp16 / bf16, whose products are exact in the fp32 accumulator."""
    if dtype != torch.float32:
        return None
    if not INTERPRET and torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return "ieee"


_OFFSET_CACHE: dict[tuple, tuple[torch.Tensor, torch.Tensor, bool]] = {}


def _source_offsets(
    sources: list[torch.Tensor], slot_source: torch.Tensor, slot_index: torch.Tensor
) -> tuple[torch.Tensor, bool]:
    """(int64 [S] element offset of each slot's matrix from sources[0]'s data pointer, aligned).

    The kernel addresses every source through one base pointer: the sources may be separate
    allocations (a parameter and a replica buffer), as device pointers share one address space
    (on CUDA also across peer-mapped GPUs). ``aligned``: every offset is a multiple of 16 elements.
    """
    base = sources[0]
    dev = base.device
    # The per-source (pointer delta, row stride) table depends only on pointers and strides: cache it
    # so steady-state calls make no host-to-device copy (and can be captured in a CUDA graph).
    key = (str(dev), base.element_size(), tuple((s.data_ptr(), s.stride(0)) for s in sources))
    hit = _OFFSET_CACHE.get(key)
    if hit is None:
        isz = base.element_size()
        deltas = []
        for i, src in enumerate(sources):
            d = src.data_ptr() - base.data_ptr()
            if d % isz:
                raise ValueError(f"ExpertWeights.sources[{i}] is not {isz}-byte aligned relative to sources[0]")
            deltas.append(d // isz)
        aligned = all(d % 16 == 0 for d in deltas) and all(s.stride(0) % 16 == 0 for s in sources)
        hit = (
            torch.tensor(deltas, dtype=torch.int64, device=dev),
            torch.tensor([s.stride(0) for s in sources], dtype=torch.int64, device=dev),
            aligned,
        )
        if len(_OFFSET_CACHE) >= 256:
            _OFFSET_CACHE.clear()
        _OFFSET_CACHE[key] = hit
    delta, stride0, aligned = hit
    src = slot_source.to(device=dev, dtype=torch.int64)
    return delta[src] + slot_index.to(device=dev, dtype=torch.int64) * stride0[src], aligned


def grouped_mm_triton(
    x: torch.Tensor,
    sources: list[torch.Tensor],
    slot_source: torch.Tensor | None,
    slot_index: torch.Tensor | None,
    offsets: torch.Tensor,
    tile_slot: torch.Tensor,
    tile_row: torch.Tensor,
    block_m: int,
) -> torch.Tensor:
    """Triton :func:`grouped_mm`: x [R, K] (unit column stride) -> [R, N] over the tile schedule."""
    R, K = x.shape
    w0 = sources[0]
    N = w0.shape[2]
    out = x.new_empty(R, N)
    B = tile_slot.shape[0]
    if R == 0 or N == 0 or B == 0:
        return out
    if x.stride(1) != 1:
        x = x.contiguous()
    cfg = gemm_config(R / max(offsets.shape[0] - 1, 1), N, K, x.dtype)
    if cfg.block_m != block_m:  # the GEMM's row tile differs from the routing block: its own schedule
        tile_slot, tile_row = tile_schedule(offsets, R, cfg.block_m)
        B = tile_slot.shape[0]
    indirect = slot_source is not None
    w_off, aligned = _source_offsets(sources, slot_source, slot_index) if indirect else (offsets, False)
    grid = (B * triton.cdiv(N, cfg.block_n),)
    _grouped_mm_kernel[grid](
        x, w0, w_off, offsets, tile_slot, tile_row, out,
        R, N, K, B, x.stride(0), w0.stride(0), w0.stride(1), w0.stride(2), out.stride(0),
        INDIRECT=indirect, W_ALIGNED=aligned, UPCAST=dot_upcast(x.dtype), RNE=bf16_rne(x.dtype), PRECISION=_precision(x.dtype),
        EVEN_K=K % cfg.block_k == 0, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return out


def grouped_mm_dw_triton(x: torch.Tensor, dy: torch.Tensor, offsets: torch.Tensor, transposed: bool) -> torch.Tensor:
    """Triton :func:`grouped_mm_dw`: x [R, K], dy [R, N] -> [S, K, N] (N-major storage if transposed)."""
    S = offsets.shape[0] - 1
    K, N = x.shape[1], dy.shape[1]
    dw = _dw_empty(S, K, N, x, transposed)
    if S == 0 or K == 0 or N == 0:
        return dw
    cfg = dw_config(x.shape[0] / S, K, N, x.dtype)
    bm, bk, bn = cfg.block_m, cfg.block_k, cfg.block_n
    grid = (S, triton.cdiv(K, bk) * triton.cdiv(N, bn))
    _grouped_mm_dw_kernel[grid](
        x, dy, offsets, dw, N, K, x.stride(0), dy.stride(0), dw.stride(0), dw.stride(1), dw.stride(2),
        UPCAST=dot_upcast(x.dtype), RNE=bf16_rne(x.dtype), PRECISION=_precision(x.dtype), BLOCK_M=bm, BLOCK_K=bk, BLOCK_N=bn,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return dw


# --------------------------------------------------------------------------------------------------
# custom ops
# --------------------------------------------------------------------------------------------------


@torch.library.custom_op("relibra::grouped_mm", mutates_args=())
def _grouped_mm_op(
    x: torch.Tensor,
    sources: list[torch.Tensor],
    slot_source: torch.Tensor | None,
    slot_index: torch.Tensor | None,
    offsets: torch.Tensor,
    tile_slot: torch.Tensor,
    tile_row: torch.Tensor,
    block_m: int,
) -> torch.Tensor:
    if use_triton(x):
        return grouped_mm_triton(x, sources, slot_source, slot_index, offsets, tile_slot, tile_row, block_m)
    return grouped_mm_torch(x, sources, slot_source, slot_index, offsets)


@_grouped_mm_op.register_fake
def _(x, sources, slot_source, slot_index, offsets, tile_slot, tile_row, block_m):
    return x.new_empty(x.shape[0], sources[0].shape[2])


def _dw_empty(S: int, K: int, N: int, like: torch.Tensor, transposed: bool) -> torch.Tensor:
    if transposed:
        return like.new_empty(S, N, K).transpose(1, 2)
    return like.new_empty(S, K, N)


@torch.library.custom_op("relibra::grouped_mm_dw", mutates_args=())
def _grouped_mm_dw_op(x: torch.Tensor, dy: torch.Tensor, offsets: torch.Tensor, transposed: bool) -> torch.Tensor:
    if use_triton(x):
        return grouped_mm_dw_triton(x, dy, offsets, transposed)
    out = grouped_mm_dw_torch(x, dy, offsets)
    res = _dw_empty(out.shape[0], out.shape[1], out.shape[2], out, transposed)
    res.copy_(out)
    return res


@_grouped_mm_dw_op.register_fake
def _(x, dy, offsets, transposed):
    return _dw_empty(offsets.shape[0] - 1, x.shape[1], dy.shape[1], x, transposed)


def _n_major(t: torch.Tensor) -> bool:
    """Whether the [K, N] matrices of t [E, K, N] are stored N-major (a transposed [E, N, K] tensor)."""
    return t.stride(1) < t.stride(2) or (t.shape[2] == 1 and t.shape[1] > 1)


def _gmm_setup(ctx, inputs, output):
    remember_backend(ctx)
    x, sources, slot_source, slot_index, offsets, tile_slot, tile_row, block_m = inputs
    ctx.block_m = block_m
    ctx.num_sources = len(sources)
    ctx.x_needs_grad = x.requires_grad
    ctx.src_needs_grad = [s.requires_grad for s in sources]
    ctx.has_index = slot_source is not None
    ctx.save_for_backward(x, offsets, tile_slot, tile_row, slot_source, slot_index, *sources)


def _source_grads_torch(
    x: torch.Tensor,
    dy: torch.Tensor,
    offsets: torch.Tensor,
    sources: list[torch.Tensor],
    slot_source: torch.Tensor,
    slot_index: torch.Tensor,
    needs_grad: list[bool],
) -> list[torch.Tensor | None]:
    """Torch reference of :func:`_source_grads` with ExpertWeights, bit for bit the same result as
    ``grouped_mm_dw_torch`` followed by ``add_slot_grads_torch`` into zeroed source grads, without the
    ``[S, K, N]`` intermediate, its layout copy and the per-row host loop: each slot's
    ``dW_s = X_s^T dY_s`` (fp32 sum, rounded to x's dtype) is written straight into its source row;
    rows shared by several slots get the fp32 sum of their rounded slot grads in increasing slot order.
    Slots of sources that need no gradient and empty slots are skipped."""
    off = offsets.tolist()
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    dsrc: list[torch.Tensor | None] = [torch.zeros_like(s) if n else None for s, n in zip(sources, needs_grad)]
    rows: dict[tuple[int, int], list[int]] = {}
    for s, (a, b) in enumerate(zip(slot_source.tolist(), slot_index.tolist(), strict=True)):
        if dsrc[a] is not None and off[s + 1] > off[s]:
            rows.setdefault((a, b), []).append(s)
    for (a, b), slots in rows.items():
        parts = [(x[off[s]:off[s + 1]].to(acc).T @ dy[off[s]:off[s + 1]].to(acc)).to(x.dtype) for s in slots]
        if len(parts) == 1:
            dsrc[a][b].add_(parts[0])  # 0 + dW as in the reference (a -0.0 becomes +0.0), no temporary
        else:
            total = torch.zeros(parts[0].shape, dtype=acc, device=x.device)
            for p in parts:
                total = total + p
            dsrc[a][b] = total.to(dsrc[a].dtype)
    return dsrc


@torch.library.custom_op("relibra::expert_weights_dw_ref", mutates_args=())
def _source_grads_ref_op(
    x: torch.Tensor,
    dy: torch.Tensor,
    offsets: torch.Tensor,
    sources: list[torch.Tensor],
    slot_source: torch.Tensor,
    slot_index: torch.Tensor,
    needs_grad: list[bool],
) -> list[torch.Tensor]:
    """:func:`_source_grads_torch` as an opaque op (host reads of the offsets stay out of tracing);
    returns the gradients of the sources that need one, in order."""
    return [g for g in _source_grads_torch(x, dy, offsets, sources, slot_source, slot_index, needs_grad)
            if g is not None]


@_source_grads_ref_op.register_fake
def _(x, dy, offsets, sources, slot_source, slot_index, needs_grad):
    return [torch.empty_like(s) for s, n in zip(sources, needs_grad, strict=True) if n]


def _source_grads(
    x: torch.Tensor,
    dy: torch.Tensor,
    offsets: torch.Tensor,
    sources: list[torch.Tensor],
    slot_source: torch.Tensor | None,
    slot_index: torch.Tensor | None,
    needs_grad: list[bool],
) -> list[torch.Tensor | None]:
    """Gradients of the weight sources: per-slot ``dW = X_s^T dY_s``, then added into the source rows
    the slots point to (deterministic; several slots may share a row)."""
    dsrc: list[torch.Tensor | None] = [None] * len(sources)
    if not any(needs_grad):
        return dsrc
    if slot_source is not None and not use_triton(x):
        it = iter(_source_grads_ref_op(x, dy, offsets, sources, slot_source, slot_index, needs_grad))
        return [next(it) if n else None for n in needs_grad]
    dw = _grouped_mm_dw_op(x, dy, offsets, _n_major(sources[0]))  # [S, K, N], the sources' layout
    if slot_source is None:
        dsrc[0] = dw
        return dsrc
    slots = torch.arange(dw.shape[0], device=dw.device, dtype=torch.int64)
    for i, src in enumerate(sources):
        if needs_grad[i]:
            g = torch.zeros_like(src)
            home = torch.where(slot_source == i, slot_index.long(), torch.full_like(slots, -1))
            _add_op(dw, slots, g, home, 16)
            dsrc[i] = g
    return dsrc


@keep_backend
def _gmm_backward(ctx, grad):
    x, offsets, tile_slot, tile_row, slot_source, slot_index, *sources = ctx.saved_tensors
    grad = grad.contiguous()
    dx = None
    if ctx.x_needs_grad:
        dx = _grouped_mm_op(
            grad,
            [s.transpose(1, 2) for s in sources],
            slot_source,
            slot_index,
            offsets,
            tile_slot,
            tile_row,
            ctx.block_m,
        )
    dsrc = _source_grads(x, grad, offsets, sources, slot_source, slot_index, ctx.src_needs_grad)
    return dx, dsrc, None, None, None, None, None, None


_grouped_mm_op.register_autograd(_gmm_backward, setup_context=_gmm_setup)


# --------------------------------------------------------------------------------------------------
# public API
# --------------------------------------------------------------------------------------------------


def _check(x: torch.Tensor, w: torch.Tensor | ExpertWeights, meta: RoutingMeta) -> None:
    S, K, _ = w.shape
    if S != meta.num_slots:
        raise ValueError(f"w has {S} slots, meta.num_slots is {meta.num_slots}")
    if x.dim() != 2 or x.shape[0] != meta.num_rows or x.shape[1] != K:
        raise ValueError(f"x_sorted must be [R={meta.num_rows}, K={K}], got shape {tuple(x.shape)}")
    if x.dtype != w.dtype:
        raise ValueError(f"x_sorted dtype {x.dtype} differs from the weights' dtype {w.dtype}")


def grouped_mm(x_sorted: torch.Tensor, w: torch.Tensor | ExpertWeights, meta: RoutingMeta) -> torch.Tensor:
    """Per-slot matmul of slot-sorted rows: ``out[r] = x_sorted[r] @ W_{slot(r)}``.

    Args:
        x_sorted: [R, K] rows in slot order (the output of :func:`~.permute.permute`).
        w: [S, K, N] tensor (any strides) or :class:`ExpertWeights`.
        meta: the routing metadata (offsets and tile schedule).

    Returns:
        [R, N] in x's dtype (fp32 accumulation); padding rows are zero. Differentiable w.r.t.
        ``x_sorted`` and the weight tensors.
    """
    _check(x_sorted, w, meta)
    sources, slot_source, slot_index = _as_sources(w)
    return _grouped_mm_op(
        x_sorted.contiguous(),
        sources,
        slot_source,
        slot_index,
        meta.offsets,
        meta.tile_slot,
        meta.tile_row,
        meta.block_m,
    )


def grouped_mm_dx(dy: torch.Tensor, w: torch.Tensor | ExpertWeights, meta: RoutingMeta) -> torch.Tensor:
    """``dX = grouped_mm(dY, W^T)``: dy [R, N] -> [R, K] (the forward kernel on the transposed view)."""
    wt = w.transpose() if isinstance(w, ExpertWeights) else w.transpose(1, 2)
    return grouped_mm(dy, wt, meta)


def grouped_mm_dw(
    x_sorted: torch.Tensor, dy: torch.Tensor, meta: RoutingMeta, transposed: bool = False
) -> torch.Tensor:
    """Per-slot weight gradient ``dW_s = X_s^T dY_s``: x [R, K], dy [R, N] -> [S, K, N] in x's dtype.

    Deterministic (fp32 accumulation in row order). ``transposed=True`` stores the result N-major
    (an [S, N, K] buffer viewed as [S, K, N]), the layout of a transposed HF parameter's gradient.
    Empty slots get zero gradients.
    """
    if x_sorted.shape[0] != meta.num_rows or dy.shape[0] != meta.num_rows:
        raise ValueError(f"x_sorted {tuple(x_sorted.shape)} and dy {tuple(dy.shape)} must have R={meta.num_rows} rows")
    return _grouped_mm_dw_op(x_sorted.contiguous(), dy.contiguous(), meta.offsets, transposed)


def swiglu(h: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for h = [gate | up] along the last dim (gate half first)."""
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def swiglu_backward(h: torch.Tensor, da: torch.Tensor) -> torch.Tensor:
    """Gradient w.r.t. h = [gate | up] of ``swiglu(h)`` given its output gradient ``da`` (fp32 math).

    d/dgate = da * up * s * (1 + gate * (1 - s)) with s = sigmoid(gate); d/dup = da * silu(gate).
    """
    gate, up = h.float().chunk(2, dim=-1)
    daf = da.float()
    sig = torch.sigmoid(gate)
    d_gate = daf * up * sig * (1 + gate * (1 - sig))
    d_up = daf * gate * sig
    return torch.cat([d_gate, d_up], dim=-1).to(h.dtype)


class _GatedExperts(torch.autograd.Function):
    """Gated expert MLP over slot-sorted rows, saving only x and h = x W_gate_up for backward.

    The activation a = act(h) is recomputed in backward instead of being saved (an [R, I] tensor per
    layer less than autograd of the composed ops keeps, plus the activation's own saved inputs).
    Backward: da = dY W_down^T, dW_down = a^T dY, dh = act'(h)^T da (closed form for SwiGLU, else
    autograd on the recomputed activation), dX = dh W_gate_up^T, dW_gate_up = X^T dh, all with the
    grouped kernels; slot gradients land in their source rows.
    """

    @staticmethod
    def forward(ctx, x, offsets, tile_slot, tile_row, block_m, n1, ss1, si1, ss2, si2, act, *sources):
        remember_backend(ctx)
        w1, w2 = list(sources[:n1]), list(sources[n1:])
        h = _grouped_mm_op(x, w1, ss1, si1, offsets, tile_slot, tile_row, block_m)
        a = swiglu(h) if act is None else act(h)
        y = _grouped_mm_op(a, w2, ss2, si2, offsets, tile_slot, tile_row, block_m)
        ctx.block_m, ctx.n1, ctx.act = block_m, n1, act
        ctx.save_for_backward(x, h, offsets, tile_slot, tile_row, ss1, si1, ss2, si2, *sources)
        return y

    @staticmethod
    @keep_backend
    def backward(ctx, dy):
        x, h, offsets, tile_slot, tile_row, ss1, si1, ss2, si2, *sources = ctx.saved_tensors
        n1, bm = ctx.n1, ctx.block_m
        w1, w2 = sources[:n1], sources[n1:]
        need = ctx.needs_input_grad
        need1, need2 = list(need[11 : 11 + n1]), list(need[11 + n1 :])
        dy = dy.contiguous()
        tiles = (offsets, tile_slot, tile_row, bm)
        da = _grouped_mm_op(dy, [w.transpose(1, 2) for w in w2], ss2, si2, *tiles)
        if ctx.act is None:
            a = swiglu(h)
            dh = swiglu_backward(h, da)
        else:
            with torch.enable_grad():
                hh = h.detach().requires_grad_()
                a = ctx.act(hh)
                (dh,) = torch.autograd.grad(a, hh, da)
            a = a.detach()
        dw2 = _source_grads(a, dy, offsets, list(w2), ss2, si2, need2)
        dx = _grouped_mm_op(dh, [w.transpose(1, 2) for w in w1], ss1, si1, *tiles) if need[0] else None
        dw1 = _source_grads(x, dh, offsets, list(w1), ss1, si1, need1)
        return (dx, None, None, None, None, None, None, None, None, None, None, *dw1, *dw2)


def swiglu_experts(
    x_sorted: torch.Tensor,
    meta: RoutingMeta,
    w_gate_up: torch.Tensor | ExpertWeights,
    w_down: torch.Tensor | ExpertWeights,
    activation: Callable[[torch.Tensor], torch.Tensor] = swiglu,
    recompute: bool = True,
) -> torch.Tensor:
    """Expert MLP on slot-sorted rows: ``grouped_mm(activation(grouped_mm(x, W_gate_up)), W_down)``.

    Args:
        x_sorted: [R, H] rows in slot order.
        meta: the routing metadata.
        w_gate_up: [S, H, 2I] (gate half first) tensor or ExpertWeights.
        w_down: [S, I, H] tensor or ExpertWeights.
        activation: maps [R, 2I] -> [R, I]; default SwiGLU ``silu(gate) * up``. Other variants (e.g.
            GPT-OSS's clamped, interleaved one) are any differentiable, stateless torch function.
        recompute: use the autograd Function that saves only x and h and recomputes the activation
            in backward (closed-form backward for the default SwiGLU; autograd on the recomputed
            activation otherwise). False: autograd differentiates the composed ops (saves more).

    Returns:
        [R, H]; padding rows stay zero. Differentiable w.r.t. x and every weight tensor.
    """
    if not recompute:
        h = grouped_mm(x_sorted, w_gate_up, meta)
        return grouped_mm(activation(h), w_down, meta)
    _check(x_sorted, w_gate_up, meta)
    S, inter2, H = w_gate_up.shape[0], w_gate_up.shape[2], x_sorted.shape[1]
    if inter2 % 2 or tuple(w_down.shape) != (S, inter2 // 2, H):
        raise ValueError(
            f"w_gate_up {tuple(w_gate_up.shape)} and w_down {tuple(w_down.shape)} must be [S, H, 2I] and [S, I, H]"
        )
    if w_down.dtype != x_sorted.dtype:
        raise ValueError(f"x_sorted dtype {x_sorted.dtype} differs from w_down's dtype {w_down.dtype}")
    src1, ss1, si1 = _as_sources(w_gate_up)
    src2, ss2, si2 = _as_sources(w_down)
    return _GatedExperts.apply(
        x_sorted.contiguous(), meta.offsets, meta.tile_slot, meta.tile_row, meta.block_m, len(src1),
        ss1, si1, ss2, si2, None if activation is swiglu else activation, *src1, *src2,
    )  # fmt: skip
