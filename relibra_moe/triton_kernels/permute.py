"""Permute tokens into slot-sorted rows, and combine expert outputs back per token (no atomics).

``permute(x [T, H], meta, scale=None) -> [R, H]``: row ``r`` is ``x[t] * scale[t, j]`` for the pair
``p = gather_idx[r] = t * k + j`` (zero for padding rows).

``combine(y [R, H], meta, weights [T, k]) -> [T, H]``: token ``t`` sums ``weights[t, j] * y[row]`` over
its routed pairs in fp32 (``row = scatter_idx[t * k + j]``, unrouted pairs contribute zero), in the
order j = 0..k-1: deterministic, one program owns each output row, no atomics.

Autograd: the backward of ``permute`` is ``combine`` (with ``scale`` as weights, or ones), the
backward of ``combine`` is ``permute`` (with ``weights`` as scale); the gradients of ``scale`` and
``weights`` are row dots ``<x[t], dy[row]>`` computed by :func:`rowdot`.

Each op is a ``torch.library.custom_op`` (namespace ``relibra``) with a fake implementation, so
``torch.compile`` graphs contain it as one node. The implementation runs the Triton kernel when
:func:`~relibra_moe.triton_kernels.backend.use_triton` says so, else the ``*_torch`` reference.
"""

from __future__ import annotations

import torch
import triton

from relibra_moe.errors import ReplayError
from relibra_moe.triton_kernels._details import permute as _k
from relibra_moe.triton_kernels.backend import INTERPRET, bf16_rne, keep_backend, remember_backend, use_triton
from relibra_moe.triton_kernels.routing import RoutingMeta

__all__ = ["combine", "combine_torch", "permute", "permute_torch", "rowdot", "rowdot_torch"]


# --------------------------------------------------------------------------------------------------
# torch references
# --------------------------------------------------------------------------------------------------


def permute_torch(x: torch.Tensor, gather_idx: torch.Tensor, top_k: int, scale: torch.Tensor | None) -> torch.Tensor:
    """Reference of :func:`permute`: x [T, H], gather_idx int [R], scale [T, k] or None -> [R, H]."""
    pair = gather_idx.long()
    valid = pair >= 0
    pair_c = pair.clamp(min=0)
    if x.shape[0] == 0:
        return x.new_zeros(pair.shape[0], x.shape[1])
    rows = x[pair_c // top_k]
    if scale is not None:
        acc = torch.float64 if x.dtype == torch.float64 else torch.float32
        rows = (rows.to(acc) * scale.reshape(-1)[pair_c].to(acc).unsqueeze(1)).to(x.dtype)
    return torch.where(valid.unsqueeze(1), rows, torch.zeros((), dtype=x.dtype, device=x.device))


def combine_torch(y: torch.Tensor, scatter_idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Reference of :func:`combine`: y [R, H], scatter_idx int [T*k], weights [T, k] -> [T, H] (fp32 sum)."""
    T, k = weights.shape
    row = scatter_idx.long().reshape(T, k)
    valid = row >= 0
    if y.shape[0] == 0:
        return y.new_zeros(T, y.shape[1])
    acc_dtype = torch.float64 if y.dtype == torch.float64 else torch.float32
    w = torch.where(valid, weights.to(acc_dtype), torch.zeros((), dtype=acc_dtype, device=y.device))
    gathered = y[row.clamp(min=0)].to(acc_dtype)  # [T, k, H]
    out = torch.zeros(T, y.shape[1], dtype=acc_dtype, device=y.device)
    for j in range(k):  # fixed order j = 0..k-1, as the kernel
        out += w[:, j : j + 1] * gathered[:, j]
    return out.to(y.dtype)


def rowdot_torch(a: torch.Tensor, b: torch.Tensor, scatter_idx: torch.Tensor, top_k: int) -> torch.Tensor:
    """Reference of :func:`rowdot`: a [T, H], b [R, H] -> fp32 [T, k], ``<a[t], b[scatter_idx[t*k+j]]>``."""
    T = a.shape[0]
    row = scatter_idx.long().reshape(T, top_k)
    valid = row >= 0
    acc_dtype = torch.float64 if a.dtype == torch.float64 else torch.float32
    if b.shape[0] == 0:
        return torch.zeros(T, top_k, dtype=acc_dtype, device=a.device)
    gathered = b[row.clamp(min=0)].to(acc_dtype)  # [T, k, H]
    dots = (gathered * a.to(acc_dtype).unsqueeze(1)).sum(-1)
    return torch.where(valid, dots, torch.zeros((), dtype=acc_dtype, device=a.device))



def _row_blocks(n_cols: int, budget: int) -> tuple[int, int]:
    """(rows per program, columns per program) for a row-wise kernel over n_cols columns.

    CUDA: column blocks of up to 1024 elements and about ``budget`` elements per program.
    Interpreter: whole rows (up to 4096 columns) and many rows per program, as its cost grows with
    the number of programs rather than with the tile size.
    """
    if INTERPRET:
        bh = min(triton.next_power_of_2(max(n_cols, 1)), 4096)
        return max(1, 8192 // bh), bh
    bh = min(triton.next_power_of_2(max(n_cols, 1)), 1024)
    return max(1, budget // bh), bh


def permute_triton(x: torch.Tensor, gather_idx: torch.Tensor, top_k: int, scale: torch.Tensor | None) -> torch.Tensor:
    """Triton :func:`permute`: x [T, H] (contiguous), gather_idx int32 [R], scale [T, k] | None -> [R, H]."""
    R, H = gather_idx.shape[0], x.shape[1]
    out = x.new_empty(R, H)
    if R == 0 or H == 0:
        return out
    if x.shape[0] == 0:
        return out.zero_()
    br, bh = _row_blocks(H, 4096)
    grid = (triton.cdiv(R, br), triton.cdiv(H, bh))
    _k.permute_kernel[grid](
        x, gather_idx, scale if scale is not None else x, out, R, H, x.stride(0), out.stride(0),
        TOP_K=top_k, HAS_SCALE=scale is not None, RNE=bf16_rne(x.dtype), BLOCK_R=br, BLOCK_H=bh, num_warps=4,
    )  # fmt: skip
    return out


def combine_triton(y: torch.Tensor, scatter_idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Triton :func:`combine`: y [R, H], scatter_idx int32 [T*k], weights [T, k] -> [T, H]."""
    T, k = weights.shape
    H = y.shape[1]
    out = y.new_empty(T, H)
    if T == 0 or H == 0:
        return out
    if y.shape[0] == 0:
        return out.zero_()
    bt, bh = _row_blocks(H, 2048)
    grid = (triton.cdiv(T, bt), triton.cdiv(H, bh))
    _k.combine_kernel[grid](
        y, scatter_idx, weights, out, T, H, y.stride(0), out.stride(0),
        TOP_K=k, RNE=bf16_rne(y.dtype), BLOCK_T=bt, BLOCK_H=bh, num_warps=4,
    )  # fmt: skip
    return out


def rowdot_triton(a: torch.Tensor, b: torch.Tensor, scatter_idx: torch.Tensor, top_k: int) -> torch.Tensor:
    """Triton :func:`rowdot`: a [T, H], b [R, H] -> fp32 [T, k]."""
    T, H = a.shape
    out = torch.zeros(T, top_k, dtype=torch.float64 if a.dtype == torch.float64 else torch.float32, device=a.device)
    if T == 0 or H == 0 or b.shape[0] == 0:
        return out
    if INTERPRET:
        bt, bh = max(1, 8192 // min(triton.next_power_of_2(H), 4096)), min(triton.next_power_of_2(H), 4096)
    else:
        bt, bh = 16, min(triton.next_power_of_2(H), 256)
    _k.rowdot_kernel[(triton.cdiv(T, bt),)](
        a, b, scatter_idx, out, T, H, a.stride(0), b.stride(0), TOP_K=top_k, BLOCK_T=bt, BLOCK_H=bh, num_warps=4
    )
    return out


# --------------------------------------------------------------------------------------------------
# custom ops (dispatch to Triton or the reference) and their autograd
# --------------------------------------------------------------------------------------------------


@torch.library.custom_op("relibra::permute", mutates_args=())
def _permute_op(x: torch.Tensor, gather_idx: torch.Tensor, top_k: int, scale: torch.Tensor | None) -> torch.Tensor:
    if use_triton(x):
        return permute_triton(x, gather_idx, top_k, scale)
    return permute_torch(x, gather_idx, top_k, scale)


@_permute_op.register_fake
def _(x, gather_idx, top_k, scale):
    return x.new_empty(gather_idx.shape[0], x.shape[1])


@torch.library.custom_op("relibra::combine", mutates_args=())
def _combine_op(y: torch.Tensor, scatter_idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    if use_triton(y):
        return combine_triton(y, scatter_idx, weights)
    return combine_torch(y, scatter_idx, weights)


@_combine_op.register_fake
def _(y, scatter_idx, weights):
    return y.new_empty(weights.shape[0], y.shape[1])


@torch.library.custom_op("relibra::rowdot", mutates_args=())
def _rowdot_op(a: torch.Tensor, b: torch.Tensor, scatter_idx: torch.Tensor, top_k: int) -> torch.Tensor:
    if use_triton(a):
        return rowdot_triton(a, b, scatter_idx, top_k)
    return rowdot_torch(a, b, scatter_idx, top_k)


@_rowdot_op.register_fake
def _(a, b, scatter_idx, top_k):
    dtype = torch.float64 if a.dtype == torch.float64 else torch.float32
    return a.new_empty(a.shape[0], top_k, dtype=dtype)


def _permute_setup(ctx, inputs, output):
    remember_backend(ctx)
    x, gather_idx, top_k, scale = inputs
    ctx.top_k = top_k
    ctx.num_tokens = x.shape[0]
    ctx.has_scale = scale is not None
    ctx.x_needs_grad = x.requires_grad
    ctx.scale_needs_grad = scale is not None and scale.requires_grad
    # scatter_idx is rebuilt from gather_idx in backward: it is the inverse permutation.
    ctx.save_for_backward(gather_idx, x if ctx.scale_needs_grad else None, scale)


def _invert_index(index: torch.Tensor, size: int) -> torch.Tensor:
    """Inverse of a partial permutation: int32 ``[size]`` with ``out[index[i]] = i``, -1 where nothing maps.

    ``index`` ``[n]`` holds distinct targets in ``[0, size)`` or -1 (padding, skipped). Gives scatter_idx
    ``[T*k]`` from gather_idx ``[R]`` and gather_idx ``[R]`` from scatter_idx ``[T*k]``; no host sync.
    """
    out = torch.full((size + 1,), -1, dtype=torch.int32, device=index.device)
    target = torch.where(index >= 0, index.long(), torch.full_like(index, size, dtype=torch.long))
    out[target] = torch.arange(index.shape[0], dtype=torch.int32, device=index.device)
    return out[:size]


@keep_backend
def _permute_backward(ctx, grad):
    gather_idx, x, scale = ctx.saved_tensors
    T, k = ctx.num_tokens, ctx.top_k
    scatter_idx = _invert_index(gather_idx, T * k)
    dx = dscale = None
    if ctx.x_needs_grad:
        w = scale if ctx.has_scale else torch.ones(T, k, dtype=grad.dtype, device=grad.device)
        dx = _combine_op(grad.contiguous(), scatter_idx, w)
    if ctx.scale_needs_grad:
        dscale = _rowdot_op(x, grad.contiguous(), scatter_idx, k).to(scale.dtype)
    return dx, None, None, dscale


_permute_op.register_autograd(_permute_backward, setup_context=_permute_setup)


def _combine_setup(ctx, inputs, output):
    remember_backend(ctx)
    y, scatter_idx, weights = inputs
    ctx.num_rows = y.shape[0]
    ctx.y_needs_grad = y.requires_grad
    ctx.w_needs_grad = weights.requires_grad
    ctx.save_for_backward(scatter_idx, weights, y if weights.requires_grad else None)


@keep_backend
def _combine_backward(ctx, grad):
    scatter_idx, weights, y = ctx.saved_tensors
    T, k = weights.shape
    grad = grad.contiguous()
    dy = dw = None
    if ctx.y_needs_grad:
        gather_idx = _invert_index(scatter_idx, ctx.num_rows)
        dy = _permute_op(grad, gather_idx, k, weights)
    if ctx.w_needs_grad:
        dw = _rowdot_op(grad, y, scatter_idx, k).to(weights.dtype)
    return dy, None, dw


_combine_op.register_autograd(_combine_backward, setup_context=_combine_setup)


# --------------------------------------------------------------------------------------------------
# public API
# --------------------------------------------------------------------------------------------------


def permute(x: torch.Tensor, meta: RoutingMeta, scale: torch.Tensor | None = None) -> torch.Tensor:
    """Gather tokens into slot-sorted rows.

    Args:
        x: [T, H] token activations.
        meta: the routing metadata of this call (``meta.num_tokens == T``).
        scale: optional [T, k] per-pair factor applied to each row (in fp32, rounded to x's dtype).

    Returns:
        [R, H] rows in slot order, zeros for padding rows. Differentiable w.r.t. ``x`` and ``scale``.

    Raises:
        ReplayError: ``x`` or ``scale`` does not match the metadata's T and k.
    """
    if x.dim() != 2 or x.shape[0] != meta.num_tokens:
        raise ReplayError(f"x must be [T={meta.num_tokens}, H], got shape {tuple(x.shape)}")
    if scale is not None and tuple(scale.shape) != (meta.num_tokens, meta.top_k):
        raise ReplayError(f"scale must be [T, k]=[{meta.num_tokens}, {meta.top_k}], got {tuple(scale.shape)}")
    return _permute_op(x.contiguous(), meta.gather_idx, meta.top_k, scale.contiguous() if scale is not None else None)


def combine(y: torch.Tensor, meta: RoutingMeta, weights: torch.Tensor) -> torch.Tensor:
    """Weighted sum of each token's expert rows: ``out[t] = sum_j weights[t, j] * y[scatter_idx[t*k+j]]``.

    Args:
        y: [R, H] expert outputs in slot order.
        meta: the routing metadata of this call (``meta.num_rows == R``).
        weights: [T, k] routing weights (unrouted pairs contribute zero whatever their weight).

    Returns:
        [T, H] in y's dtype, summed in fp32 in the order j = 0..k-1. Differentiable w.r.t. ``y`` and
        ``weights``.
    """
    if y.dim() != 2 or y.shape[0] != meta.num_rows:
        raise ReplayError(f"y must be [R={meta.num_rows}, H], got shape {tuple(y.shape)}")
    if tuple(weights.shape) != (meta.num_tokens, meta.top_k):
        raise ReplayError(f"weights must be [T, k]=[{meta.num_tokens}, {meta.top_k}], got {tuple(weights.shape)}")
    return _combine_op(y.contiguous(), meta.scatter_idx, weights.contiguous())


def rowdot(a: torch.Tensor, b: torch.Tensor, meta: RoutingMeta) -> torch.Tensor:
    """fp32 [T, k] row dots ``<a[t], b[scatter_idx[t*k+j]]>`` (0 for unrouted pairs); a [T, H], b [R, H]."""
    if a.dim() != 2 or a.shape[0] != meta.num_tokens:
        raise ReplayError(f"a must be [T={meta.num_tokens}, H], got shape {tuple(a.shape)}")
    if b.dim() != 2 or b.shape[0] != meta.num_rows or b.shape[1] != a.shape[1]:
        raise ReplayError(f"b must be [R={meta.num_rows}, H={a.shape[1]}], got shape {tuple(b.shape)}")
    return _rowdot_op(a.contiguous(), b.contiguous(), meta.scatter_idx, meta.top_k)
