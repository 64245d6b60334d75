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

Each op is a ``torch.library.custom_op`` (namespace ``relibra``) with a fake implementation, so
``torch.compile`` graphs can contain it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from relibra_moe.triton_kernels.backend import use_triton
from relibra_moe.triton_kernels.replica_copy import add_slot_grads
from relibra_moe.triton_kernels.routing import RoutingMeta

_TRITON_READY = False  # flipped when the Triton kernels land

__all__ = [
    "ExpertWeights",
    "grouped_mm",
    "grouped_mm_dw",
    "grouped_mm_dw_torch",
    "grouped_mm_dx",
    "grouped_mm_torch",
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
        if not self.slot_source.is_cuda and self.slot_source.numel():
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
    for s, w in enumerate(mats):
        a, b = off[s], off[s + 1]
        if b > a:
            out[a:b] = x[a:b] @ w
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
    if _TRITON_READY and use_triton(x):
        from relibra_moe.triton_kernels import _gemm_kernels as kern

        return kern.grouped_mm_triton(x, sources, slot_source, slot_index, offsets, tile_slot, tile_row, block_m)
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
    if _TRITON_READY and use_triton(x):
        from relibra_moe.triton_kernels import _gemm_kernels as kern

        return kern.grouped_mm_dw_triton(x, dy, offsets, transposed)
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
    x, sources, slot_source, slot_index, offsets, tile_slot, tile_row, block_m = inputs
    ctx.block_m = block_m
    ctx.num_sources = len(sources)
    ctx.x_needs_grad = x.requires_grad
    ctx.src_needs_grad = [s.requires_grad for s in sources]
    ctx.has_index = slot_source is not None
    ctx.save_for_backward(x, offsets, tile_slot, tile_row, slot_source, slot_index, *sources)


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
    dsrc: list[torch.Tensor | None] = [None] * ctx.num_sources
    if any(ctx.src_needs_grad):
        transposed = _n_major(sources[0])
        dw = _grouped_mm_dw_op(x, grad, offsets, transposed)  # [S, K, N]
        if not ctx.has_index:
            dsrc[0] = dw
        else:
            S = dw.shape[0]
            slots = torch.arange(S, device=dw.device, dtype=torch.int64)
            for i, src in enumerate(sources):
                if not ctx.src_needs_grad[i]:
                    continue
                g = torch.zeros_like(src)
                home = torch.where(slot_source == i, slot_index.long(), torch.full_like(slots, -1))
                add_slot_grads(dw, slots, g, home)
                dsrc[i] = g
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


def swiglu_experts(
    x_sorted: torch.Tensor,
    meta: RoutingMeta,
    w_gate_up: torch.Tensor | ExpertWeights,
    w_down: torch.Tensor | ExpertWeights,
    activation: Callable[[torch.Tensor], torch.Tensor] = swiglu,
) -> torch.Tensor:
    """Expert MLP on slot-sorted rows: ``grouped_mm(activation(grouped_mm(x, W_gate_up)), W_down)``.

    Args:
        x_sorted: [R, H] rows in slot order.
        meta: the routing metadata.
        w_gate_up: [S, H, 2I] (gate half first) tensor or ExpertWeights.
        w_down: [S, I, H] tensor or ExpertWeights.
        activation: maps [R, 2I] -> [R, I]; default SwiGLU ``silu(gate) * up``. Other variants (e.g.
            GPT-OSS's clamped, interleaved one) are any differentiable torch function here.

    Returns:
        [R, H]; autograd flows through the composed ops (padding rows stay zero).
    """
    h = grouped_mm(x_sorted, w_gate_up, meta)
    return grouped_mm(activation(h), w_down, meta)
