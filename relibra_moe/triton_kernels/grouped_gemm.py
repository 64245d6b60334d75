"""Grouped GEMM over slot-sorted rows: forward, dX and dW, plus a SwiGLU expert MLP built from them.

``grouped_mm(x_sorted [R, K], w, meta) -> [R, N]``: sorted row r of slot s is multiplied by ``W_s``
[K, N]. Rows are unpadded: a tile holds up to ``BLOCK_M`` rows of one slot; padding rows (after the
routed pairs) come out as zeros. The GEMM's tile config (``BLOCK_M`` included) comes from the shapes
(:mod:`~relibra_moe.triton_kernels.heuristics`); the routing block ``meta.block_m`` is independent:
when it differs from the GEMM's row tile, the GEMM builds its own schedule from ``meta.offsets``
(:func:`~relibra_moe.triton_kernels.routing.tile_schedule`, torch ops, no host sync).

Weights ``w`` are either

* a tensor [S, K, N] with any strides, so a Hugging Face parameter stored as [E, N, K] is passed as
  ``param.transpose(1, 2)`` without a copy; or
* an :class:`ExpertWeights` indirection: slot s uses ``sources[slot_source[s]][slot_index[s]]``, e.g.
  the home experts' parameter and the replica slots of the layer-shared buffer, never concatenated.

Both are differentiable w.r.t. ``x_sorted`` and every weight tensor; gradients land in the source
rows the slots point to (several slots reading one source row sum deterministically).

Backward: ``dX = grouped_mm(dY, W^T)`` (the same kernel on the transposed view) and
``dW_s = X_s^T dY_s`` (:func:`weight_grads_into`). The dW kernel is destination-major: its
destinations are the rows of the weight *sources* (each source's gradient is written in place,
once, through per-row element offsets: no zero fill, no [S, K, N] intermediate, no add-back pass;
rows no slot reads get zeros), programs run slot-major (all output tiles of one slot are resident
together, so its x / dY rows stay in L2), heaviest slots first, and a hot slot is split over rows
with a deterministic fp32 reduction of its parts. With the layer's home + replica-slot sources, only
the replica slots' gradients are then added into their home experts (by the replica buffer).

Expert MLP: :func:`swiglu_experts` is an autograd Function over these ops that saves only x and
h = x W_gate_up and recomputes the activation in backward. SwiGLU runs fused on the Triton path:
the gate_up GEMM computes ``a = silu(gate) * up`` in its epilogue, and the backward's
``da = dY W_down^T`` GEMM computes ``dh`` and the recomputed ``a`` in its epilogue, so the MLP runs
no elementwise pass over [R, 2I]. Other activations (e.g. GPT-OSS's clamped interleaved one) use
autograd on the recomputed activation.

Precision: fp32 accumulation; fp16 / bf16 use tensor cores, fp32 follows
``torch.backends.cuda.matmul.allow_tf32``. Configs are heuristics per (rows per slot, N, K, dtype),
no autotuning. ExpertWeights addresses every source from sources[0]'s pointer plus a per-slot
element offset (cached per pointer set, so steady-state calls do no host-to-device copy).

Each op is a ``torch.library.custom_op`` (namespace ``relibra``) with a fake implementation, so
``torch.compile`` graphs can contain it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton

from relibra_moe.triton_kernels._details import grouped_gemm as _k
from relibra_moe.triton_kernels._details.grouped_gemm import EPI_PLAIN, EPI_SWIGLU, EPI_SWIGLU_BWD
from relibra_moe.triton_kernels.backend import (
    INTERPRET,
    bf16_rne,
    dot_upcast,
    keep_backend,
    remember_backend,
    use_triton,
)
from relibra_moe.triton_kernels.heuristics import dw_config, gemm_config
from relibra_moe.triton_kernels.routing import RoutingMeta, indices_trusted, tile_schedule

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
    "weight_grads_into",
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
        if not self.slot_source.is_cuda and self.slot_source.numel() and not indices_trusted():
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


def _launch_gemm(
    x: torch.Tensor,
    sources: list[torch.Tensor],
    slot_source: torch.Tensor | None,
    slot_index: torch.Tensor | None,
    offsets: torch.Tensor,
    tile_slot: torch.Tensor,
    tile_row: torch.Tensor,
    block_m: int,
    epilogue: int,
    out: torch.Tensor,
    h: torch.Tensor | None = None,
    a: torch.Tensor | None = None,
) -> None:
    """Launch :func:`~relibra_moe.triton_kernels._details.grouped_gemm.grouped_mm_kernel` with ``epilogue`` (outputs as in its docstring, preallocated).

    ``N`` is ``out``'s width (PLAIN, SWIGLU) or half of it (SWIGLU_BWD). The tile config comes from
    :func:`~.heuristics.gemm_config`; when its row tile differs from ``block_m`` (the routing
    block) the schedule of the GEMM's own row tile is built from ``offsets``.
    """
    R, K = x.shape
    w0 = sources[0]
    N = out.shape[1] // 2 if epilogue == EPI_SWIGLU_BWD else out.shape[1]
    B = tile_slot.shape[0]
    if R == 0 or N == 0 or B == 0:
        return
    if x.stride(1) != 1:
        x = x.contiguous()
    gated = epilogue != EPI_PLAIN
    cfg = gemm_config(R / max(offsets.shape[0] - 1, 1), 2 * N if gated else N, K, x.dtype, gated=gated,
                      swiglu_bwd=epilogue == EPI_SWIGLU_BWD)  # fmt: skip
    block_n = cfg.block_n // 2 if gated else cfg.block_n
    if cfg.block_m != block_m:
        tile_slot, tile_row = tile_schedule(offsets, R, cfg.block_m)
        B = tile_slot.shape[0]
    indirect = slot_source is not None
    w_off, aligned = _source_offsets(sources, slot_source, slot_index) if indirect else (offsets, False)
    hh = out if h is None else h
    aa = out if a is None else a
    grid = (B * triton.cdiv(N, block_n),)
    _k.grouped_mm_kernel[grid](
        x, w0, w_off, offsets, tile_slot, tile_row, out, hh, aa,
        R, N, K, B, x.stride(0), w0.stride(0), w0.stride(1), w0.stride(2), out.stride(0), hh.stride(0), aa.stride(0),
        INDIRECT=indirect, W_ALIGNED=aligned, UPCAST=dot_upcast(x.dtype), RNE=bf16_rne(x.dtype),
        PRECISION=_precision(x.dtype), EVEN_K=K % cfg.block_k == 0, EPILOGUE=epilogue, STORE_H=h is not None,
        BLOCK_M=cfg.block_m, BLOCK_N=block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )  # fmt: skip


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
    out = x.new_empty(x.shape[0], sources[0].shape[2])
    _launch_gemm(x, sources, slot_source, slot_index, offsets, tile_slot, tile_row, block_m, EPI_PLAIN, out)
    return out


#: Most row splits of one hot slot in the weight-gradient kernel.
DW_SPLIT_MAX = 8
#: (BLOCK_K, BLOCK_N) of the split reduction: 32 fp32 values per thread at 4 warps.
DW_REDUCE_TILE = (32, 128)


def _num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (132 on an H100 / H200 where there is none: the
    interpreter, whose split policy only matters for what it tests)."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).multi_processor_count)
    return 132


@functools.lru_cache(maxsize=64)
def _dest_tables(sizes: tuple[int, ...], device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(source, row) int64 [D] of every destination row of gradient tensors with ``sizes`` rows."""
    src = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes, dtype=torch.int64))
    row = torch.cat([torch.arange(n) for n in sizes]) if sizes else torch.zeros(0, dtype=torch.int64)
    return src.to(device), row.to(device)


@functools.lru_cache(maxsize=64)
def _source_bases(sizes: tuple[int, ...], needs_grad: tuple[bool, ...], device: str) -> torch.Tensor:
    """int64 [num_sources]: the first destination row of each source that needs a gradient (-1 if
    not), destinations being the rows of those sources concatenated in order."""
    base, bases = 0, []
    for n, need in zip(sizes, needs_grad, strict=True):
        bases.append(base if need else -1)
        base += n if need else 0
    return torch.tensor(bases, dtype=torch.int64).to(device)


def weight_grads_into(
    x: torch.Tensor,
    dy: torch.Tensor,
    offsets: torch.Tensor,
    grads: list[torch.Tensor],
    slot_dest: torch.Tensor,
) -> None:
    """Triton weight gradient written in place: ``grads`` rows are the destinations (concatenated in
    list order, ``D`` rows in all), ``slot_dest`` int64 [S] the destination of each slot (-1: none).

    Destination d gets ``sum over slots s with slot_dest[s] == d of X_s^T dY_s`` (fp32, increasing s,
    rounded once), zeros when no slot points to it; every destination is written exactly once, so the
    gradient tensors need no zero fill and no add-back pass. ``grads``: [E_i, K, N] tensors sharing
    their K / N strides. Hot slots (more than ``split_rows`` rows, see :class:`~.heuristics.DwConfig`)
    are split over rows with a deterministic fp32 reduction; its workspace is at most about
    ``2 * SMs`` output tiles of fp32.
    """
    R, K = x.shape
    N = dy.shape[1]
    grads = [g for g in grads if g.shape[0] > 0]
    if not grads or K == 0 or N == 0:
        return
    dev = x.device
    S = offsets.shape[0] - 1
    D = sum(int(g.shape[0]) for g in grads)
    src_of_dest, row_of_dest = _dest_tables(tuple(int(g.shape[0]) for g in grads), str(dev))
    dest_off, _ = _source_offsets(grads, src_of_dest, row_of_dest)
    key = torch.where(slot_dest >= 0, slot_dest, torch.full_like(slot_dest, D))
    sorted_key, order = torch.sort(key, stable=True)
    seg = torch.searchsorted(sorted_key, torch.arange(D + 1, device=dev, dtype=sorted_key.dtype))
    counts = (offsets[1:] - offsets[:-1]).to(torch.int64)
    rows_d = torch.zeros(D + 1, dtype=torch.int64, device=dev).scatter_add_(0, key, counts)[:D]
    prog_order = torch.argsort(rows_d, descending=True, stable=True)  # most rows first
    cfg = dw_config(R / max(S, 1), K, N, x.dtype)
    tiles = triton.cdiv(K, cfg.block_k) * triton.cdiv(N, cfg.block_n)
    split_rows = cfg.split_rows or max(4 * cfg.block_m, triton.cdiv(R * tiles, _num_sms(dev)))
    n_hot_max = min(D, R // (split_rows + 1))
    if n_hot_max:
        # A hot destination has more than split_rows rows and one slot; each part of it is at most
        # split_rows rows, so the parts number fewer than 2 R / split_rows.
        hot = (rows_d > split_rows) & ((seg[1:] - seg[:-1]) == 1)
        nsplit = torch.where(hot, ((rows_d + split_rows - 1) // split_rows).clamp(max=DW_SPLIT_MAX), 1)
        parts = torch.where(hot, nsplit, 0)
        part = torch.cumsum(parts, 0) - parts
        rank = torch.cumsum(hot.to(torch.int64), 0) - hot.to(torch.int64)
        hot_list = torch.full((n_hot_max + 1,), -1, dtype=torch.int64, device=dev)
        hot_list.scatter_(0, torch.where(hot, rank, n_hot_max), torch.arange(D, device=dev))
        hot_list = hot_list[:n_hot_max]
        ws = torch.empty(min(n_hot_max * DW_SPLIT_MAX, 2 * R // split_rows + 1), K, N, dtype=torch.float32,
                         device=dev)  # fmt: skip
        split_max = DW_SPLIT_MAX
    else:
        nsplit = torch.ones(D, dtype=torch.int64, device=dev)
        part = torch.zeros(D, dtype=torch.int64, device=dev)
        ws = torch.empty(0, dtype=torch.float32, device=dev)
        split_max = 1
    g0 = grads[0]
    i32 = torch.int32
    _k.grouped_mm_dw_kernel[(D * split_max * tiles,)](
        x, dy, offsets, prog_order.to(i32), seg.to(i32), order.to(i32), dest_off, nsplit.to(i32), part.to(i32), ws, g0,
        N, K, x.stride(0), dy.stride(0), g0.stride(1), g0.stride(2),
        UPCAST=dot_upcast(x.dtype), RNE=bf16_rne(x.dtype), PRECISION=_precision(x.dtype), SPLIT_MAX=split_max,
        BLOCK_M=cfg.block_m, BLOCK_K=cfg.block_k, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )  # fmt: skip
    if n_hot_max:
        rk, rn = DW_REDUCE_TILE
        _k.dw_reduce_kernel[(n_hot_max * triton.cdiv(K, rk) * triton.cdiv(N, rn),)](
            hot_list.to(i32), nsplit.to(i32), part.to(i32), dest_off, ws, g0, N, K, g0.stride(1), g0.stride(2),
            RNE=bf16_rne(x.dtype), BLOCK_K=rk, BLOCK_N=rn, num_warps=4,
        )  # fmt: skip


def grouped_mm_dw_triton(x: torch.Tensor, dy: torch.Tensor, offsets: torch.Tensor, transposed: bool) -> torch.Tensor:
    """Triton :func:`grouped_mm_dw`: x [R, K], dy [R, N] -> [S, K, N] (N-major storage if transposed)."""
    S = offsets.shape[0] - 1
    dw = _dw_empty(S, x.shape[1], dy.shape[1], x, transposed)
    weight_grads_into(x, dy, offsets, [dw], torch.arange(S, device=x.device, dtype=torch.int64))
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


@torch.library.custom_op("relibra::swiglu_mm", mutates_args=())
def _swiglu_mm_op(
    x: torch.Tensor,
    sources: list[torch.Tensor],
    slot_source: torch.Tensor | None,
    slot_index: torch.Tensor | None,
    offsets: torch.Tensor,
    tile_slot: torch.Tensor,
    tile_row: torch.Tensor,
    block_m: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(a, h): h = x W_gate_up [R, 2I] and a = swiglu(h) [R, I]; Triton: SwiGLU in the GEMM epilogue."""
    inter = sources[0].shape[2] // 2
    if use_triton(x):
        a = x.new_empty(x.shape[0], inter)
        h = x.new_empty(x.shape[0], 2 * inter)
        _launch_gemm(x, sources, slot_source, slot_index, offsets, tile_slot, tile_row, block_m, EPI_SWIGLU, a, h=h)
        return a, h
    h = grouped_mm_torch(x, sources, slot_source, slot_index, offsets)
    return swiglu(h), h


@_swiglu_mm_op.register_fake
def _(x, sources, slot_source, slot_index, offsets, tile_slot, tile_row, block_m):
    inter = sources[0].shape[2] // 2
    return x.new_empty(x.shape[0], inter), x.new_empty(x.shape[0], 2 * inter)


@torch.library.custom_op("relibra::swiglu_mm_backward", mutates_args=())
def _swiglu_mm_backward_op(
    dy: torch.Tensor,
    sources_t: list[torch.Tensor],
    slot_source: torch.Tensor | None,
    slot_index: torch.Tensor | None,
    offsets: torch.Tensor,
    tile_slot: torch.Tensor,
    tile_row: torch.Tensor,
    block_m: int,
    h: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dh, a): da = dY W_down^T (``sources_t`` are W_down's [.., H, I] views), dh = swiglu'(h)^T da
    [R, 2I], a = swiglu(h) [R, I]; Triton: both in the GEMM epilogue."""
    if use_triton(dy):
        dh = dy.new_empty(h.shape)
        a = dy.new_empty(h.shape[0], h.shape[1] // 2)
        _launch_gemm(dy, sources_t, slot_source, slot_index, offsets, tile_slot, tile_row, block_m, EPI_SWIGLU_BWD,
                     dh, h=h, a=a)  # fmt: skip
        return dh, a
    da = grouped_mm_torch(dy, sources_t, slot_source, slot_index, offsets)
    return swiglu_backward(h, da), swiglu(h)


@_swiglu_mm_backward_op.register_fake
def _(dy, sources_t, slot_source, slot_index, offsets, tile_slot, tile_row, block_m, h):
    return dy.new_empty(h.shape), dy.new_empty(h.shape[0], h.shape[1] // 2)


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
    """Torch reference of the ExpertWeights source gradients (what :func:`weight_grads_into` writes):
    source row (i, j) gets the fp32 sum, in increasing slot order, of ``X_s^T dY_s`` over the slots
    pointing to it, rounded once to x's dtype; zeros when none does. Sources that need no gradient
    get ``None``."""
    off = offsets.tolist()
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    dsrc: list[torch.Tensor | None] = [torch.zeros_like(s) if n else None for s, n in zip(sources, needs_grad)]
    rows: dict[tuple[int, int], list[int]] = {}
    for s, (a, b) in enumerate(zip(slot_source.tolist(), slot_index.tolist(), strict=True)):
        if dsrc[a] is not None and off[s + 1] > off[s]:
            rows.setdefault((a, b), []).append(s)
    for (a, b), slots in rows.items():
        total = torch.zeros(x.shape[1], dy.shape[1], dtype=acc, device=x.device)
        for s in slots:
            total += x[off[s]:off[s + 1]].to(acc).T @ dy[off[s]:off[s + 1]].to(acc)
        dsrc[a][b] = total.to(dsrc[a].dtype)
    return dsrc


def _grad_like(src: torch.Tensor, n_major: bool) -> torch.Tensor:
    """An uninitialised gradient for ``src`` [E, K, N] in the common layout of the sources."""
    return _dw_empty(src.shape[0], src.shape[1], src.shape[2], src, n_major)


@torch.library.custom_op("relibra::weight_grads", mutates_args=())
def _weight_grads_op(
    x: torch.Tensor,
    dy: torch.Tensor,
    offsets: torch.Tensor,
    sources: list[torch.Tensor],
    slot_source: torch.Tensor | None,
    slot_index: torch.Tensor | None,
    needs_grad: list[bool],
) -> list[torch.Tensor]:
    """The gradients of the weight sources that need one, in order (see :func:`_source_grads`)."""
    n_major = _n_major(sources[0])
    if use_triton(x):
        grads = [_grad_like(s, n_major) for s, n in zip(sources, needs_grad, strict=True) if n]
        if slot_source is None:
            slot_dest = torch.arange(sources[0].shape[0], device=x.device, dtype=torch.int64)
        else:
            sizes = tuple(int(s.shape[0]) for s in sources)
            b = _source_bases(sizes, tuple(needs_grad), str(x.device))[slot_source.long()]
            slot_dest = torch.where(b >= 0, b + slot_index.long(), torch.full_like(b, -1))
        weight_grads_into(x, dy, offsets, grads, slot_dest)
        return grads
    if slot_source is None:
        g = _grad_like(sources[0], n_major)
        g.copy_(grouped_mm_dw_torch(x, dy, offsets))
        return [g]
    return [g for g in _source_grads_torch(x, dy, offsets, sources, slot_source, slot_index, needs_grad)
            if g is not None]  # fmt: skip


@_weight_grads_op.register_fake
def _(x, dy, offsets, sources, slot_source, slot_index, needs_grad):
    n_major = _n_major(sources[0])
    return [_grad_like(s, n_major) for s, n in zip(sources, needs_grad, strict=True) if n]


def _source_grads(
    x: torch.Tensor,
    dy: torch.Tensor,
    offsets: torch.Tensor,
    sources: list[torch.Tensor],
    slot_source: torch.Tensor | None,
    slot_index: torch.Tensor | None,
    needs_grad: list[bool],
) -> list[torch.Tensor | None]:
    """Gradients of the weight sources (``None`` where not needed): each slot's ``dW = X_s^T dY_s`` is
    written straight into the source row it reads (several slots sharing a row are summed in fp32 in
    increasing slot order); rows no slot reads get zeros. No zero fill, no add-back pass."""
    if not any(needs_grad):
        return [None] * len(sources)
    it = iter(_weight_grads_op(x, dy, offsets, sources, slot_source, slot_index, needs_grad))
    return [next(it) if n else None for n in needs_grad]


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

    SwiGLU (``act is None``) runs fused: the forward's gate_up GEMM computes a = swiglu(h) in its
    epilogue (and stores h), the backward's da GEMM computes dh and the recomputed a in its
    epilogue, so no elementwise pass over [R, 2I] runs on the Triton path.
    """

    @staticmethod
    def forward(ctx, x, offsets, tile_slot, tile_row, block_m, n1, ss1, si1, ss2, si2, act, *sources):
        remember_backend(ctx)
        w1, w2 = list(sources[:n1]), list(sources[n1:])
        if act is None:
            a, h = _swiglu_mm_op(x, w1, ss1, si1, offsets, tile_slot, tile_row, block_m)
        else:
            h = _grouped_mm_op(x, w1, ss1, si1, offsets, tile_slot, tile_row, block_m)
            a = act(h)
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
        w2t = [w.transpose(1, 2) for w in w2]
        if ctx.act is None:
            dh, a = _swiglu_mm_backward_op(dy, w2t, ss2, si2, *tiles, h)
        else:
            da = _grouped_mm_op(dy, w2t, ss2, si2, *tiles)
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
