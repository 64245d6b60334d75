"""CUDA-only checks of the compiled kernels (skipped without a GPU): Triton vs the torch reference at
moderate bf16 shapes, bitwise determinism of every op, ExpertWeights across two allocations, the
16-program replica copy, and no host sync in routing_metadata.

These tests run compiled kernels only. In an interpreter process (the default CPU target of
``tests/conftest.py``) the module runs itself in a child pytest process of the CUDA target
(``RELIBRA_TEST_DEVICE=cuda``, ``TRITON_INTERPRET=0``) and its other tests skip here; in a compiled
process they run directly.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from relibra_moe.triton_kernels import backend as kernel_backend
from relibra_moe.triton_kernels.backend import force_backend, kernel_mode
from relibra_moe.triton_kernels.grouped_gemm import ExpertWeights, grouped_mm, grouped_mm_dw, swiglu_experts
from relibra_moe.triton_kernels.permute import combine, permute
from relibra_moe.triton_kernels.replica_copy import add_slot_grads, copy_into_slots
from relibra_moe.triton_kernels.routing import routing_metadata

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(autouse=True)
def _compiled_process(request):
    if kernel_backend.INTERPRET and request.node.name != "test_compiled_suite_in_a_child_process":
        pytest.skip("interpreter process: this test runs compiled in test_compiled_suite_in_a_child_process")


@pytest.mark.timeout(900)
def test_compiled_suite_in_a_child_process():
    """From an interpreter process: the whole module again in a child of the CUDA target, compiled."""
    if not kernel_backend.INTERPRET:
        pytest.skip("this process runs compiled kernels: the module's tests run here directly")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["RELIBRA_TEST_DEVICE"] = "cuda"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=840)
    assert res.returncode == 0, res.stdout[-6000:] + res.stderr[-3000:]


def test_kernels_are_compiled():
    from relibra_moe.triton_kernels._details import grouped_gemm as gg_kernels  # the @triton.jit kernels
    from relibra_moe.triton_kernels._details import permute as pm
    from relibra_moe.triton_kernels._details import replica_copy as rc

    assert kernel_mode(torch.device("cuda")) == "compiled"
    kinds = {type(v).__name__ for m in (gg_kernels, pm, rc) for v in vars(m).values()
             if type(v).__name__ in ("JITFunction", "InterpretedFunction")}
    assert kinds == {"JITFunction"}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1e-12))


def _case(T=1000, k=8, E=32, H=512, inter=256, block_m=64, seed=0):
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(seed)
    ids = torch.rand(T, E, generator=g, device=dev).topk(k, dim=1).indices
    ids[: T // 10, 0] = 3  # a hot expert: skewed counts
    ids = torch.where(torch.rand(T, k, generator=g, device=dev) < 0.05, -1, ids)  # some unrouted pairs
    meta = routing_metadata(ids, E, block_m=block_m)
    x = torch.randn(T, H, generator=g, device=dev, dtype=torch.bfloat16)
    w = torch.rand(T, k, generator=g, device=dev)
    wg = (torch.randn(E, 2 * inter, H, generator=g, device=dev) * H**-0.5).to(torch.bfloat16).transpose(1, 2)
    wd = (torch.randn(E, inter, H, generator=g, device=dev) * inter**-0.5).to(torch.bfloat16)
    return meta, x, w, wg, wd


def _moe(meta, x, w, wg, wd):
    leaves = [t.detach().clone().requires_grad_() for t in (x, w, wg, wd)]
    out = combine(swiglu_experts(permute(leaves[0], meta), meta, leaves[2], leaves[3]), meta, leaves[1])
    out.float().square().sum().backward()
    return [out.detach()] + [t.grad for t in leaves]


@pytest.mark.parametrize("block_m", [64, 128])
def test_triton_matches_reference_and_is_deterministic(block_m):
    meta, x, w, wg, wd = _case(block_m=block_m)
    with force_backend("torch"):
        ref = _moe(meta, x, w, wg, wd)
    with force_backend("triton"):
        a = _moe(meta, x, w, wg, wd)
        b = _moe(meta, x, w, wg, wd)
    for name, r, u, v in zip(("out", "dx", "dw_route", "dw_gate_up", "dw_down"), ref, a, b, strict=True):
        assert torch.equal(u, v), f"{name} not bitwise deterministic"
        assert _rel(u, r) <= 2e-2, (name, _rel(u, r))


def test_expert_weights_two_allocations_and_padding_rows():
    meta, x, _, wg, _ = _case(T=300, E=16)
    xs = permute(x, meta)
    rep = torch.empty(4, *wg.shape[1:], device="cuda", dtype=wg.dtype).transpose(1, 2).contiguous()
    rep = rep.transpose(1, 2)  # a separate allocation in the same layout as the HF view
    src = torch.zeros(16, dtype=torch.long, device="cuda")
    idx = torch.arange(16, device="cuda")
    src[[2, 7, 9, 15]] = 1
    idx[[2, 7, 9, 15]] = torch.arange(4, device="cuda")
    copy_into_slots(wg, torch.tensor([2, 7, 9, 15], device="cuda"), rep, torch.arange(4, device="cuda"))
    out_ew = grouped_mm(xs, ExpertWeights((wg, rep), src, idx), meta)
    out = grouped_mm(xs, wg, meta)
    assert torch.equal(out_ew, out)
    routed = int(meta.counts.sum())
    assert not out[routed:].any()  # zero tiles cleared the padding rows of an uninitialised output


def test_replica_copy_and_add_back_16_programs():
    g = torch.Generator(device="cuda").manual_seed(1)
    src = torch.randn(32, 768, 2048, generator=g, device="cuda").to(torch.bfloat16)
    buf = torch.zeros(8, 768, 2048, device="cuda", dtype=torch.bfloat16)
    si, di = torch.randperm(32, device="cuda")[:8], torch.arange(8, device="cuda")
    copy_into_slots(src, si, buf, di, num_programs=16)
    assert torch.equal(buf, src[si])
    home = torch.zeros_like(src)
    add_slot_grads(buf, di, home, si % 4, num_programs=16)
    ref = torch.zeros_like(src, dtype=torch.float32)
    for i in range(8):
        ref[int(si[i]) % 4] += buf[i].float()
    assert _rel(home.float(), ref) <= 8e-3


def test_routing_metadata_and_dw_without_host_sync():
    meta, x, _, _, _ = _case(T=512)
    ids = torch.randint(-1, 32, (512, 8), device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any device->host sync raises
    try:
        m = routing_metadata(ids, 32, block_m=64)
        xs = permute(x, m)
        grouped_mm_dw(xs, xs, m)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert int(m.counts.sum()) == int((ids >= 0).sum())
