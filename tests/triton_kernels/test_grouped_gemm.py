"""Grouped GEMM (fwd, dX, dW), ExpertWeights indirection and SwiGLU experts against float64 references."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from relibra_moe.triton_kernels.backend import force_backend
from relibra_moe.triton_kernels.grouped_gemm import (
    ExpertWeights,
    grouped_mm,
    grouped_mm_dw,
    grouped_mm_dx,
    swiglu_experts,
)
from relibra_moe.triton_kernels.routing import routing_metadata

BACKENDS = ["torch", "triton"]
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 8e-3}


def rel_err(a: torch.Tensor, ref: np.ndarray) -> float:
    if ref.size == 0:
        return 0.0
    return float(np.abs(a.detach().double().numpy() - ref).max() / max(float(np.abs(ref).max()), 1e-6))


def make_ids(T: int, k: int, S: int, seed: int, mode: str) -> torch.Tensor:
    g = np.random.default_rng(seed)
    if T == 0:
        return torch.zeros(0, k, dtype=torch.long)
    ids = np.stack([g.permutation(S)[:k] for _ in range(T)])
    if mode == "hot":
        ids[:, 0] = S - 1
        ids[:, 1:] = -1
    elif mode == "drop":
        ids[g.random((T, k)) < 0.3] = -1
    return torch.from_numpy(ids)


def row_slots(meta) -> list[int]:
    """Slot of every sorted row from the counts (plain loop), -1 for padding rows."""
    out = []
    for s, c in enumerate(meta.counts.tolist()):
        out += [s] * c
    return out + [-1] * (meta.num_rows - len(out))


CASES = [  # (T, k, S, K, N, mode, block_m)
    (5, 2, 4, 24, 17, "random", 16),  # T < BLOCK_M, odd N
    (20, 2, 3, 16, 32, "hot", 16),  # one slot takes every pair (multi-tile), empty slots
    (9, 3, 3, 33, 16, "drop", 16),  # k = E, odd K, padding rows
    (12, 1, 5, 16, 24, "random", 16),  # k = 1
    (0, 2, 3, 16, 16, "random", 16),  # R = 0
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", CASES)
def test_forward_dx_dw_match_float64(backend, dtype, case):
    T, k, S, K, N, mode, bm = case
    meta = routing_metadata(make_ids(T, k, S, seed=K + N, mode=mode), S, block_m=bm)
    g = torch.Generator().manual_seed(0)
    R = meta.num_rows
    x = torch.randn(R, K, generator=g).to(dtype)
    hf = torch.randn(S, N, K, generator=g).to(dtype)  # HF layout [E, N, K]
    w = hf.transpose(1, 2)  # [S, K, N] view, no copy
    dy = torch.randn(R, N, generator=g).to(dtype)
    slots = row_slots(meta)
    x64, w64, dy64 = x.double().numpy(), w.double().numpy(), dy.double().numpy()
    ref = np.zeros((R, N))
    ref_dx = np.zeros((R, K))
    ref_dw = np.zeros((S, K, N))
    for r, s in enumerate(slots):
        if s >= 0:
            ref[r] = x64[r] @ w64[s]
            ref_dx[r] = dy64[r] @ w64[s].T
            ref_dw[s] += np.outer(x64[r], dy64[r])
    with force_backend(backend):
        out = grouped_mm(x, w, meta)
        dx = grouped_mm_dx(dy, w, meta)
        dw = grouped_mm_dw(x, dy, meta)
        dw_t = grouped_mm_dw(x, dy, meta, transposed=True)
    assert out.shape == (R, N) and out.dtype == dtype
    tol = TOL[dtype]
    assert rel_err(out, ref) <= tol
    assert rel_err(dx, ref_dx) <= tol
    assert rel_err(dw, ref_dw) <= tol
    assert dw_t.stride(1) == 1 or K == 1
    assert torch.equal(dw_t, dw)
    n_routed = int(meta.counts.sum())
    assert not out[n_routed:].any() and not dx[n_routed:].any()


def make_expert_weights(S, K, N, dtype, g):
    """Home experts [E, N, K] (HF layout) plus a 3-slot replica buffer in the same layout."""
    home = torch.randn(4, N, K, generator=g).to(dtype)
    rep = torch.randn(3, N, K, generator=g).to(dtype)
    slot_source = torch.tensor([0, 0, 1, 0, 1, 0][:S])
    slot_index = torch.tensor([0, 1, 2, 2, 0, 3][:S])
    return home, rep, slot_source, slot_index


@pytest.mark.parametrize("backend", BACKENDS)
def test_expert_weights_indirection_and_grads(backend):
    T, k, S, K, N = 13, 2, 6, 16, 24
    meta = routing_metadata(make_ids(T, k, S, seed=5, mode="random"), S, block_m=16)
    g = torch.Generator().manual_seed(3)
    home, rep, src, idx = make_expert_weights(S, K, N, torch.float32, g)
    x = torch.randn(meta.num_rows, K, generator=g)
    dy = torch.randn(meta.num_rows, N, generator=g)
    home.requires_grad_()
    rep.requires_grad_()
    x.requires_grad_()
    ew = ExpertWeights((home.transpose(1, 2), rep.transpose(1, 2)), src, idx)
    dense = ew.materialize().detach().double()  # [S, K, N]
    with force_backend(backend):
        out = grouped_mm(x, ew, meta)
        out.backward(dy)
    slots = row_slots(meta)
    x64, dy64 = x.detach().double(), dy.double()
    ref = torch.stack([x64[r] @ dense[s] for r, s in enumerate(slots)])
    assert rel_err(out, ref.numpy()) <= 2e-5
    ref_dx = torch.stack([dy64[r] @ dense[s].T for r, s in enumerate(slots)])
    assert rel_err(x.grad, ref_dx.numpy()) <= 2e-5
    # slot s's gradient lands in sources[src[s]][idx[s]]; slot 3 (home 2) and slot 2 (replica 2) differ
    ref_home = torch.zeros(4, N, K, dtype=torch.float64)
    ref_rep = torch.zeros(3, N, K, dtype=torch.float64)
    for r, s in enumerate(slots):
        target = ref_home if int(src[s]) == 0 else ref_rep
        target[int(idx[s])] += torch.outer(dy64[r], x64[r])
    assert rel_err(home.grad, ref_home.numpy()) <= 2e-5
    assert rel_err(rep.grad, ref_rep.numpy()) <= 2e-5
    assert home.grad.stride() == home.stride()


def test_gradcheck_reference_float64():
    T, k, S, K, N = 6, 2, 4, 3, 5
    meta = routing_metadata(make_ids(T, k, S, seed=9, mode="drop"), S, block_m=4)
    g = torch.Generator().manual_seed(4)
    d = torch.float64
    x = torch.randn(meta.num_rows, K, generator=g, dtype=d, requires_grad=True)
    w = torch.randn(S, N, K, generator=g, dtype=d, requires_grad=True)
    home = torch.randn(3, K, N, generator=g, dtype=d, requires_grad=True)
    rep = torch.randn(2, K, N, generator=g, dtype=d, requires_grad=True)
    src, idx = torch.tensor([0, 1, 0, 1]), torch.tensor([0, 0, 2, 0])  # replica 0 used by two slots
    wg = torch.randn(S, K, 4, generator=g, dtype=d, requires_grad=True)
    wd = torch.randn(S, 2, K, generator=g, dtype=d, requires_grad=True)
    with force_backend("torch"):
        assert torch.autograd.gradcheck(lambda a, b: grouped_mm(a, b.transpose(1, 2), meta), (x, w))
        assert torch.autograd.gradcheck(
            lambda a, h, r: grouped_mm(a, ExpertWeights((h, r), src, idx), meta), (x, home, rep)
        )
        assert torch.autograd.gradcheck(lambda a, b, c: swiglu_experts(a, meta, b, c), (x, wg, wd))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_experts_kernel_vs_reference(dtype):
    if "triton" not in BACKENDS:
        pytest.skip("Triton kernels not registered yet")
    T, k, S, H, inter = 10, 2, 4, 16, 16
    meta = routing_metadata(make_ids(T, k, S, seed=2, mode="drop"), S, block_m=16)
    g = torch.Generator().manual_seed(5)
    x0 = torch.randn(meta.num_rows, H, generator=g).to(dtype)
    wg0 = (torch.randn(S, H, 2 * inter, generator=g) / 4).to(dtype)
    wd0 = (torch.randn(S, inter, H, generator=g) / 4).to(dtype)
    res = {}
    for backend in BACKENDS:
        x, wg, wd = (t.clone().requires_grad_() for t in (x0, wg0, wd0))
        with force_backend(backend):
            out = swiglu_experts(x, meta, wg, wd)
            (out.float() * torch.linspace(-1, 1, H)).sum().backward()
        res[backend] = (out.detach(), x.grad, wg.grad, wd.grad)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    for a, b in zip(res["torch"], res["triton"], strict=True):
        scale = b.float().abs().max().clamp(min=1e-6)
        assert float((a.float() - b.float()).abs().max() / scale) <= tol


def test_errors():
    meta = routing_metadata(torch.tensor([[0, 1]]), 2)
    with pytest.raises(ValueError, match="slots"):
        grouped_mm(torch.zeros(2, 4), torch.zeros(3, 4, 5), meta)
    with pytest.raises(ValueError, match="dtype"):
        grouped_mm(torch.zeros(2, 4), torch.zeros(2, 4, 5, dtype=torch.float64), meta)
    with pytest.raises(ValueError, match="x_sorted must be"):
        grouped_mm(torch.zeros(2, 3), torch.zeros(2, 4, 5), meta)
    with pytest.raises(ValueError, match="strides"):
        ExpertWeights(
            (torch.zeros(2, 4, 5), torch.zeros(2, 5, 4).transpose(1, 2)), torch.tensor([0, 1]), torch.tensor([0, 0])
        )
    with pytest.raises(ValueError, match="slot_index"):
        ExpertWeights((torch.zeros(2, 4, 5),), torch.tensor([0, 0]), torch.tensor([0, 2]))


@settings(max_examples=12)
@given(
    T=st.integers(0, 40),
    k=st.integers(1, 3),
    S=st.integers(3, 6),
    K=st.sampled_from([16, 24, 40]),
    N=st.sampled_from([16, 20, 48]),
    mode=st.sampled_from(["random", "hot", "drop"]),
    bm=st.sampled_from([16, 32]),
    seed=st.integers(0, 1000),
)
def test_kernel_matches_float64_loops_hypothesis(T, k, S, K, N, mode, bm, seed):
    """Triton forward and dW on random shapes and routings against per-row float64 loops."""
    meta = routing_metadata(make_ids(T, k, S, seed=seed, mode=mode), S, block_m=bm)
    g = torch.Generator().manual_seed(seed)
    R = meta.num_rows
    x = torch.randn(R, K, generator=g)
    big = torch.randn(S + 1, K, 2 * N, generator=g)
    w = big[1:, :, ::2]  # offset storage, stride 2 along N: "any strides"
    dy = torch.randn(R, N, generator=g)
    with force_backend("triton"):
        out = grouped_mm(x, w, meta)
        dw = grouped_mm_dw(x, dy, meta)
    ref = np.zeros((R, N))
    ref_dw = np.zeros((S, K, N))
    x64, w64, dy64 = x.double().numpy(), w.double().numpy(), dy.double().numpy()
    for r, s in enumerate(row_slots(meta)):
        if s >= 0:
            ref[r] = x64[r] @ w64[s]
            ref_dw[s] += np.outer(x64[r], dy64[r])
    assert rel_err(out, ref) <= 2e-5
    assert rel_err(dw, ref_dw) <= 2e-5


def gpt_oss_act(h: torch.Tensor) -> torch.Tensor:
    """GPT-OSS-style activation: interleaved gate/up, clamped, (up + 1) * gate * sigmoid(1.702 gate)."""
    gate, up = h[..., ::2].clamp(max=0.5), h[..., 1::2].clamp(-0.5, 0.5)
    return (up + 1) * gate * torch.sigmoid(1.702 * gate)


@pytest.mark.parametrize("act", ["swiglu", "gpt_oss"])
@pytest.mark.parametrize("recompute", [True, False])
def test_swiglu_experts_expert_weights_vs_dense_float64(recompute, act):
    """Fused (recomputing) and composed SwiGLU experts, weights from home + replica sources, against
    a dense float64 per-row computation differentiated by autograd."""
    T, k, S, H, inter = 9, 2, 5, 16, 16
    meta = routing_metadata(make_ids(T, k, S, seed=11, mode="drop"), S, block_m=16)
    g = torch.Generator().manual_seed(7)
    hf_gu = torch.randn(3, 2 * inter, H, generator=g) / 4  # home gate_up in HF layout [E, 2I, H]
    rep_gu = torch.randn(2, 2 * inter, H, generator=g) / 4
    home_dn = torch.randn(3, inter, H, generator=g) / 4
    rep_dn = torch.randn(2, inter, H, generator=g) / 4
    src, idx = torch.tensor([0, 1, 0, 0, 1]), torch.tensor([0, 0, 1, 2, 1])
    x = torch.randn(meta.num_rows, H, generator=g)
    dy = torch.randn(meta.num_rows, H, generator=g)
    leaves = [t.clone().requires_grad_() for t in (x, hf_gu, rep_gu, home_dn, rep_dn)]
    with force_backend("triton"):
        w1 = ExpertWeights((leaves[1].transpose(1, 2), leaves[2].transpose(1, 2)), src, idx)
        w2 = ExpertWeights((leaves[3], leaves[4]), src, idx)
        kw = {} if act == "swiglu" else {"activation": gpt_oss_act}
        out = swiglu_experts(leaves[0], meta, w1, w2, recompute=recompute, **kw)
        out.backward(dy)
    ref_leaves = [t.double().clone().requires_grad_() for t in (x, hf_gu, rep_gu, home_dn, rep_dn)]
    xr, gu_h, gu_r, dn_h, dn_r = ref_leaves
    rows = []
    for r, s in enumerate(row_slots(meta)):
        if s < 0:
            rows.append(torch.zeros(H, dtype=torch.float64))
            continue
        gu = (gu_h if int(src[s]) == 0 else gu_r)[int(idx[s])].T  # [H, 2I]
        dn = (dn_h if int(src[s]) == 0 else dn_r)[int(idx[s])]  # [I, H]
        hh = xr[r] @ gu
        a = torch.nn.functional.silu(hh[:inter]) * hh[inter:] if act == "swiglu" else gpt_oss_act(hh)
        rows.append(a @ dn)
    ref = torch.stack(rows)
    ref.backward(dy.double())
    assert rel_err(out, ref.detach().numpy()) <= 2e-5
    for a, b in zip(leaves, ref_leaves, strict=True):
        assert rel_err(a.grad, b.grad.numpy()) <= 2e-5


def test_swiglu_experts_no_rows():
    """R = 0: empty output, zero weight gradients (Triton path)."""
    meta = routing_metadata(torch.zeros(0, 2, dtype=torch.long), 3, block_m=16)
    x = torch.zeros(0, 16, requires_grad=True)
    wg = torch.randn(3, 16, 32, requires_grad=True)
    wd = torch.randn(3, 16, 16, requires_grad=True)
    with force_backend("triton"):
        out = swiglu_experts(x, meta, wg, wd)
        out.sum().backward()
    assert out.shape == (0, 16)
    assert not wg.grad.any() and not wd.grad.any() and x.grad.shape == (0, 16)


@pytest.mark.parametrize(("K", "N", "dtype"), [(160, 136, torch.float32), (256, 48, torch.bfloat16)])
def test_multi_block_loops(K, N, dtype):
    """Loops the small cases never enter: several K iterations (masked tail and even), several
    N-blocks, more tiles than one GROUP_M swizzle group, and dW slots longer than its row block."""
    T, k, S, bm = 100, 2, 3, 16
    meta = routing_metadata(make_ids(T, k, S, seed=4, mode="random"), S, block_m=bm)
    assert meta.num_tiles > 8 and int(meta.counts.max()) > 64
    g = torch.Generator().manual_seed(8)
    R = meta.num_rows
    x = torch.randn(R, K, generator=g).to(dtype)
    w = torch.randn(S, K, N, generator=g).to(dtype)
    dy = torch.randn(R, N, generator=g).to(dtype)
    with force_backend("triton"):
        out = grouped_mm(x, w, meta)
        dw = grouped_mm_dw(x, dy, meta)
    x64, w64, dy64 = x.double().numpy(), w.double().numpy(), dy.double().numpy()
    ref = np.zeros((R, N))
    ref_dw = np.zeros((S, K, N))
    for r, s in enumerate(row_slots(meta)):
        if s >= 0:
            ref[r] = x64[r] @ w64[s]
            ref_dw[s] += np.outer(x64[r], dy64[r])
    tol = TOL[dtype]
    assert rel_err(out, ref) <= tol
    assert rel_err(dw, ref_dw) <= tol


def weight_grad_case(dtype, transposed, seed=9):
    """ExpertWeights over 3 sources with source rows shared by two slots, an empty slot, an unused
    source row and a source that needs no gradient; float64 loop reference of the source grads."""
    T, k, S, K, N = 17, 2, 7, 12, 10
    ids = make_ids(T, k, S, seed=2, mode="random")
    ids[ids == 5] = 6  # slot 5 empty
    meta = routing_metadata(ids, S, block_m=16)
    g = torch.Generator().manual_seed(seed)
    shape = (N, K) if transposed else (K, N)
    srcs = [torch.randn(4, *shape, generator=g).to(dtype), torch.randn(3, *shape, generator=g).to(dtype),
            torch.randn(2, *shape, generator=g).to(dtype)]
    if transposed:
        srcs = [s.transpose(1, 2) for s in srcs]
    slot_source = torch.tensor([0, 1, 0, 1, 0, 0, 2])
    slot_index = torch.tensor([2, 0, 2, 0, 1, 3, 1])  # (0, 2) and (1, 0) twice; source 0 row 0 unused
    x = torch.randn(meta.num_rows, K, generator=g).to(dtype)
    dy = torch.randn(meta.num_rows, N, generator=g).to(dtype)
    need = [True, True, False]
    ref = [torch.zeros(s.shape, dtype=torch.float64) for s in srcs]
    for r, s in enumerate(row_slots(meta)):
        if s >= 0:
            ref[int(slot_source[s])][int(slot_index[s])] += torch.outer(x[r].double(), dy[r].double())
    return meta, srcs, slot_source, slot_index, x, dy, need, ref


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("transposed", [False, True])
def test_expert_weights_grads_in_place_against_loops(backend, dtype, transposed):
    """Each source row's gradient is written once, in the sources' layout: the fp32 sum of the slots
    reading it (rows shared by two slots), zeros where no slot reads it, None for a frozen source."""
    from relibra_moe.triton_kernels import grouped_gemm as gg

    if backend == "triton" and dtype == torch.float64:
        pytest.skip("the kernels take fp32 / fp16 / bf16")
    meta, srcs, slot_source, slot_index, x, dy, need, ref = weight_grad_case(dtype, transposed)
    with force_backend(backend):
        got = gg._source_grads(x, dy, meta.offsets, srcs, slot_source, slot_index, need)
        again = gg._source_grads(x, dy, meta.offsets, srcs, slot_source, slot_index, need)
    assert got[2] is None
    tol = {torch.float64: 1e-12, **TOL}[dtype]
    for i in (0, 1):
        assert got[i].stride() == srcs[i].stride() and got[i].dtype == dtype
        assert rel_err(got[i], ref[i].numpy()) <= tol
        assert torch.equal(got[i], again[i])  # deterministic
    assert torch.equal(got[0][0], torch.zeros_like(got[0][0]))  # row no slot reads: zeros (no zero fill pass)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_dw_hot_slot_split_over_rows(dtype, monkeypatch):
    """A hot slot split over rows (forced small split_rows) reduces its fp32 parts in a fixed order:
    the result matches float64 loops, is bitwise reproducible, and cold / empty / shared-row
    destinations next to it are unaffected."""
    from relibra_moe.triton_kernels import grouped_gemm as gg
    from relibra_moe.triton_kernels._details import grouped_gemm as gg_kernels
    from relibra_moe.triton_kernels.heuristics import DwConfig, override

    T, k, S, K, N = 60, 1, 4, 32, 16
    ids = torch.full((T, k), 3)
    ids[:5, 0] = 0  # slot 0: 5 rows, slot 1, 2 empty, slot 3: 55 rows (hot)
    meta = routing_metadata(ids, S, block_m=16)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(meta.num_rows, K, generator=g).to(dtype)
    dy = torch.randn(meta.num_rows, N, generator=g).to(dtype)
    home = torch.randn(3, K, N, generator=g).to(dtype)
    rep = torch.randn(1, K, N, generator=g).to(dtype)
    src, idx = torch.tensor([0, 0, 0, 1]), torch.tensor([0, 1, 2, 0])
    ref = torch.zeros(S, K, N, dtype=torch.float64)
    for r, s in enumerate(row_slots(meta)):
        ref[s] += torch.outer(x[r].double(), dy[r].double())
    launches = []
    reduce_kernel = gg_kernels.dw_reduce_kernel

    class Counting:  # counts the launches of the split reduction, so the test knows the split ran
        def __getitem__(self, grid):
            launches.append(grid)
            return reduce_kernel[grid]

    monkeypatch.setattr(gg_kernels, "dw_reduce_kernel", Counting())
    outs = []
    for split_rows in (16, 16, 0):  # forced split twice, then the automatic policy (no split here)
        with force_backend("triton"), override(dw=DwConfig(16, 16, 16, 4, 1, split_rows=split_rows)):
            gh, gr = gg._source_grads(x, dy, meta.offsets, [home, rep], src, idx, [True, True])
            dense = grouped_mm_dw(x, dy, meta)
        outs.append(torch.cat([gh, gr]))
        assert len(launches) == (2 if split_rows else 0)
        launches.clear()
        assert rel_err(dense, ref.numpy()) <= TOL[dtype]
    assert rel_err(outs[0], ref.numpy()) <= TOL[dtype]
    assert torch.equal(outs[0], outs[1])
    assert rel_err(outs[2], ref.numpy()) <= TOL[dtype]
    assert not outs[0][1:3].any()


@pytest.mark.parametrize("backend", BACKENDS)
def test_weight_grads_op_opcheck(backend):
    """The weight-gradient op is a well-formed custom op (schema, fake kernel with the sources'
    strides, dynamic-shape tracing)."""
    from relibra_moe.triton_kernels import grouped_gemm as gg

    meta = routing_metadata(make_ids(9, 2, 4, seed=1, mode="random"), 4, block_m=16)
    g = torch.Generator().manual_seed(2)
    home = torch.randn(3, 6, 8, generator=g).transpose(1, 2)  # N-major, as HF parameters
    rep = torch.randn(2, 6, 8, generator=g).transpose(1, 2)
    x, dy = torch.randn(meta.num_rows, 8, generator=g), torch.randn(meta.num_rows, 6, generator=g)
    args = (x, dy, meta.offsets, [home, rep], torch.tensor([0, 1, 0, 1]), torch.tensor([0, 0, 2, 0]), [True, False])
    with force_backend(backend):
        torch.library.opcheck(gg._weight_grads_op, args,
                              test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))
        (gh,) = gg._weight_grads_op(*args)
    assert gh.stride() == home.stride()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("T", "mode"), [(40, "hot"), (5, "drop"), (12, "random")])
def test_fused_swiglu_mlp_against_float64(dtype, T, mode, monkeypatch):
    """The Triton SwiGLU MLP runs the activation and its derivative inside the GEMM epilogues (the
    elementwise torch functions are never called) and matches a float64 autograd reference in output
    and every gradient: replica slots (ExpertWeights over home + replica sources), empty experts,
    T < BLOCK_M, one hot expert taking every pair (multi-tile)."""
    from relibra_moe.triton_kernels import grouped_gemm as gg

    def forbidden(*args, **kwargs):
        raise AssertionError("separate elementwise SwiGLU pass on the Triton path")

    monkeypatch.setattr(gg, "swiglu_backward", forbidden)
    k, S, H, inter = 2, 5, 32, 24
    meta = routing_metadata(make_ids(T, k, S, seed=T, mode=mode), S, block_m=16)
    g = torch.Generator().manual_seed(T)
    home_gu = (torch.randn(3, 2 * inter, H, generator=g) / 4).to(dtype)  # HF layout [E, 2I, H]
    rep_gu = (torch.randn(2, 2 * inter, H, generator=g) / 4).to(dtype)
    home_dn = (torch.randn(3, inter, H, generator=g) / 4).to(dtype)
    rep_dn = (torch.randn(2, inter, H, generator=g) / 4).to(dtype)
    src, idx = torch.tensor([0, 0, 0, 1, 1]), torch.tensor([0, 1, 2, 0, 1])  # slots 3, 4: replica slots
    x = torch.randn(meta.num_rows, H, generator=g).to(dtype)
    dy = torch.randn(meta.num_rows, H, generator=g).to(dtype)
    leaves = [t.clone().requires_grad_() for t in (x, home_gu, rep_gu, home_dn, rep_dn)]
    with force_backend("triton"):
        monkeypatch.setattr(gg, "swiglu", forbidden)
        w1 = ExpertWeights((leaves[1].transpose(1, 2), leaves[2].transpose(1, 2)), src, idx)
        w2 = ExpertWeights((leaves[3], leaves[4]), src, idx)
        out = gg._GatedExperts.apply(
            leaves[0], meta.offsets, meta.tile_slot, meta.tile_row, meta.block_m, 2, src, idx, src, idx, None,
            *w1.sources, *w2.sources,
        )  # fmt: skip
        out.backward(dy)
    ref_leaves = [t.double().clone().requires_grad_() for t in (x, home_gu, rep_gu, home_dn, rep_dn)]
    xr, gu_h, gu_r, dn_h, dn_r = ref_leaves
    rows = []
    for r, s in enumerate(row_slots(meta)):
        if s < 0:
            rows.append(torch.zeros(H, dtype=torch.float64))
            continue
        gu = (gu_h if int(src[s]) == 0 else gu_r)[int(idx[s])].T
        dn = (dn_h if int(src[s]) == 0 else dn_r)[int(idx[s])]
        hh = xr[r] @ gu
        rows.append((torch.nn.functional.silu(hh[:inter]) * hh[inter:]) @ dn)
    ref = torch.stack(rows)
    ref.backward(dy.double())
    tol = {torch.float32: 2e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}[dtype]
    assert rel_err(out, ref.detach().numpy()) <= tol
    for a, b in zip(leaves, ref_leaves, strict=True):
        want = torch.zeros_like(b) if b.grad is None else b.grad  # experts no row reaches: zero gradients
        assert a.grad.shape == want.shape and rel_err(a.grad, want.detach().numpy()) <= tol
        if b.grad is None:
            assert not a.grad.any()
    n = int(meta.counts.sum())
    assert not out[n:].any() and not leaves[0].grad[n:].any()


@pytest.mark.parametrize("transposed", [False, True])
def test_weight_grads_written_once_without_zero_fill(transposed, monkeypatch):
    """The Triton source gradients start uninitialised (here: NaN-filled) and every element is written
    by the dW kernel itself: no zero fill is relied on and no add-back pass reads them (it would
    propagate the NaNs), including the rows no slot reads and rows two slots share."""
    from relibra_moe.triton_kernels import grouped_gemm as gg

    grad_like = gg._grad_like
    monkeypatch.setattr(gg, "_grad_like", lambda src, n_major: grad_like(src, n_major).fill_(float("nan")))
    meta, srcs, slot_source, slot_index, x, dy, need, ref = weight_grad_case(torch.float32, transposed)
    with force_backend("triton"):
        got = gg._source_grads(x, dy, meta.offsets, srcs, slot_source, slot_index, need)
    for i in (0, 1):
        assert not got[i].isnan().any()
        assert rel_err(got[i], ref[i].numpy()) <= 2e-5
