"""The kernel ops as torch.library custom ops: opcheck (schema, fake, autograd registration) and a
fullgraph torch.compile of routing -> permute -> SwiGLU experts -> combine, forward and backward."""

from __future__ import annotations

import pytest
import torch

from relibra_moe.triton_kernels import replica_copy  # noqa: F401  (registers relibra::copy_into_slots, add_slot_grads)
from relibra_moe.triton_kernels.backend import force_backend
from relibra_moe.triton_kernels.grouped_gemm import ExpertWeights, grouped_mm, swiglu_experts
from relibra_moe.triton_kernels.permute import combine, permute
from relibra_moe.triton_kernels.routing import routing_metadata


def _case(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    T, k, S, H, inter = 7, 2, 4, 16, 16
    ids = torch.stack([torch.randperm(S, generator=g)[:k] for _ in range(T)])
    ids[0, 1] = -1
    x = torch.randn(T, H, generator=g)
    w = torch.rand(T, k, generator=g)
    wg = torch.randn(S, H, 2 * inter, generator=g) / 4
    wd = torch.randn(S, inter, H, generator=g) / 4
    return ids, x, w, wg, wd, S


TEST_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def test_opcheck_all_ops():
    ids, x, w, wg, wd, S = _case()
    meta = routing_metadata(ids, S, block_m=16)
    xs = permute(x, meta).detach()
    home = wg[:3].clone().requires_grad_()
    rep = wg[3:].clone().requires_grad_()
    src, idx = torch.tensor([0, 1, 0, 0]), torch.tensor([0, 0, 2, 1])
    samples = [
        (torch.ops.relibra.permute, (x.requires_grad_(), meta.gather_idx, 2, w.requires_grad_())),
        (torch.ops.relibra.combine, (xs.clone().requires_grad_(), meta.scatter_idx, w)),
        (torch.ops.relibra.rowdot, (x.detach(), xs, meta.scatter_idx, 2)),
        (
            torch.ops.relibra.grouped_mm,
            (xs.clone().requires_grad_(), [home, rep], src, idx, meta.offsets, meta.tile_slot, meta.tile_row, 16),
        ),
        (
            torch.ops.relibra.grouped_mm,
            (
                xs,
                [wg.transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()],
                None,
                None,
                meta.offsets,
                meta.tile_slot,
                meta.tile_row,
                16,
            ),
        ),
        (
            torch.ops.relibra.swiglu_mm,  # differentiated by the MLP's autograd Function, not on its own
            (xs, [home.detach(), rep.detach()], src, idx, meta.offsets, meta.tile_slot, meta.tile_row, 16),
        ),
        (
            torch.ops.relibra.swiglu_mm_backward,
            (xs, [home.detach()[:, :, :16].transpose(1, 2), rep.detach()[:, :, :16].transpose(1, 2)], src, idx,
             meta.offsets, meta.tile_slot, meta.tile_row, 16, torch.randn(xs.shape[0], 32)),
        ),  # fmt: skip
        (torch.ops.relibra.weight_grads,
         (xs, torch.randn(xs.shape[0], 32), meta.offsets, [home.detach(), rep.detach()], src, idx, [True, False])),
        (torch.ops.relibra.grouped_mm_dw, (xs, xs, meta.offsets, True)),
        (torch.ops.relibra.grouped_mm_dw, (xs, xs, meta.offsets, False)),
    ]
    with force_backend("torch"):
        for op, args in samples:
            torch.library.opcheck(op, args, test_utils=TEST_UTILS)
        buf = torch.zeros(2, 16, 32)
        torch.library.opcheck(
            torch.ops.relibra.copy_into_slots, (wg, torch.tensor([1, 3]), buf, torch.tensor([1, 0]), 4),
            test_utils=("test_schema", "test_faketensor"),
        )  # fmt: skip
        torch.library.opcheck(
            torch.ops.relibra.add_slot_grads, (wg[:2].clone(), torch.tensor([0, 1]), buf, torch.tensor([1, 1]), 4),
            test_utils=("test_schema", "test_faketensor"),
        )  # fmt: skip


def moe(ids, x, w, wg, wd, S):
    meta = routing_metadata(ids, S, block_m=16)
    return combine(swiglu_experts(permute(x, meta), meta, wg, wd), meta, w)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_compile_fullgraph_matches_eager(backend):
    ids, x, w, wg, wd, S = _case(1)
    leaves = [t.clone().requires_grad_() for t in (x, w, wg, wd)]
    leaves_c = [t.clone().requires_grad_() for t in (x, w, wg, wd)]
    compiled = torch.compile(moe, backend="aot_eager", fullgraph=True, dynamic=False)
    with force_backend(backend):
        out = moe(ids, *leaves, S)
        out_c = compiled(ids, *leaves_c, S)
        out.square().sum().backward()
        out_c.square().sum().backward()
    torch.testing.assert_close(out_c, out, rtol=1e-5, atol=1e-5)
    for a, b in zip(leaves, leaves_c, strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-5)


def test_compile_expert_weights():
    ids, x, _, wg, _, S = _case(2)
    home, rep = wg[:2].clone().requires_grad_(), wg[2:].clone().requires_grad_()
    src, idx = torch.tensor([0, 1, 0, 1]), torch.tensor([0, 1, 1, 0])

    def f(x, home, rep):
        meta = routing_metadata(ids, S, block_m=16)
        return grouped_mm(permute(x, meta), ExpertWeights((home, rep), src, idx), meta)

    with force_backend("torch"):
        ref = f(x, home, rep)
        ref.sum().backward()
        g = home.grad.clone(), rep.grad.clone()
        home.grad = rep.grad = None
        out = torch.compile(f, backend="aot_eager", fullgraph=True)(x, home, rep)
        out.sum().backward()
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(home.grad, g[0])
    torch.testing.assert_close(rep.grad, g[1])
