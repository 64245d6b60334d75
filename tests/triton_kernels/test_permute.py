"""permute / combine / rowdot against float64 loops, on the reference and the Triton (interpreter) path."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from relibra_moe.errors import ReplayError
from relibra_moe.triton_kernels.backend import force_backend
from relibra_moe.triton_kernels.permute import combine, permute, rowdot
from relibra_moe.triton_kernels.routing import routing_metadata

BACKENDS = ["torch", "triton"]
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 8e-3, torch.float64: 1e-12}


def rel_err(a: torch.Tensor, ref: np.ndarray) -> float:
    a = a.detach().double().numpy()
    scale = max(float(np.abs(ref).max()), 1e-6) if ref.size else 1.0
    return float(np.abs(a - ref).max() / scale) if ref.size else 0.0


def make_ids(T: int, k: int, S: int, seed: int, mode: str = "random") -> torch.Tensor:
    g = np.random.default_rng(seed)
    if mode == "hot":
        ids = np.zeros((T, k), dtype=np.int64) + 1
        ids[:, 1:] = -1  # one slot takes every routed pair
    else:
        ids = np.stack([g.permutation(S)[:k] for _ in range(T)]) if T else np.zeros((0, k), dtype=np.int64)
        if mode == "drop":
            ids[g.random((T, k)) < 0.3] = -1
    return torch.from_numpy(ids.astype(np.int64))


def loops(ids: np.ndarray, S: int):
    T, k = ids.shape
    gather = [p for s in range(S) for p in range(T * k) if ids[p // k, p % k] == s]
    scatter = {p: r for r, p in enumerate(gather)}
    return gather, scatter


CASES = [  # (T, k, S, H, mode)
    (5, 2, 4, 33, "random"),  # T < BLOCK_M, odd H
    (9, 3, 3, 16, "random"),  # k = E
    (7, 1, 6, 40, "drop"),  # k = 1 with unrouted pairs
    (6, 2, 5, 24, "hot"),  # one slot takes everything, empty slots
    (0, 2, 3, 8, "random"),  # T = 0, R = 0
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", CASES)
def test_permute_combine_match_loops(backend, dtype, case):
    T, k, S, H, mode = case
    ids = make_ids(T, k, S, seed=T + k, mode=mode)
    meta = routing_metadata(ids, S, block_m=16)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, H, generator=g).to(dtype)
    scale = torch.rand(T, k, generator=g).to(dtype)
    y = torch.randn(meta.num_rows, H, generator=g).to(dtype)
    w = torch.rand(T, k, generator=g).to(dtype)
    gather, scatter = loops(ids.numpy(), S)
    x64, s64, y64, w64 = (t.double().numpy() for t in (x, scale, y, w))
    ref_p = np.zeros((T * k, H))
    for r, p in enumerate(gather):
        ref_p[r] = x64[p // k] * s64[p // k, p % k]
    ref_c = np.zeros((T, H))
    ref_d = np.zeros((T, k))
    for t in range(T):
        for j in range(k):
            if t * k + j in scatter:
                ref_c[t] += w64[t, j] * y64[scatter[t * k + j]]
                ref_d[t, j] = x64[t] @ y64[scatter[t * k + j]]
    with force_backend(backend):
        out_p = permute(x, meta, scale)
        out_p1 = permute(x, meta)
        out_c = combine(y, meta, w)
        out_d = rowdot(x, y, meta)
    assert out_p.shape == (T * k, H) and out_p.dtype == dtype
    assert out_c.shape == (T, H) and out_c.dtype == dtype
    assert out_d.dtype == torch.float32
    tol = TOL[dtype]
    assert rel_err(out_p, ref_p) <= tol
    assert rel_err(out_c, ref_c) <= tol
    assert rel_err(out_d, ref_d) <= 1e-5
    ref_p1 = np.zeros((T * k, H))
    for r, p in enumerate(gather):
        ref_p1[r] = x64[p // k]
    assert rel_err(out_p1, ref_p1) == 0.0  # a pure gather is exact
    assert not out_p[len(gather) :].any()  # padding rows are zero


def test_gradcheck_reference_float64():
    ids = make_ids(6, 2, 4, seed=1, mode="drop")
    meta = routing_metadata(ids, 4, block_m=4)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 5, generator=g, dtype=torch.float64, requires_grad=True)
    s = torch.rand(6, 2, generator=g, dtype=torch.float64, requires_grad=True)
    y = torch.randn(12, 5, generator=g, dtype=torch.float64, requires_grad=True)
    with force_backend("torch"):
        assert torch.autograd.gradcheck(lambda a, b: permute(a, meta, b), (x, s))
        assert torch.autograd.gradcheck(lambda a: permute(a, meta), (x,))
        assert torch.autograd.gradcheck(lambda a, b: combine(a, meta, b), (y, s))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kernel_gradients_match_reference(dtype):
    """Gradients of sum(c * combine(2 permute(x, s), s)) on both paths, against the closed form in float64.

    out[t] = 2 x[t] sum_j s[t,j]^2 over routed pairs, so dx[t] = 2 c sum_j s[t,j]^2 and
    ds[t,j] = 4 s[t,j] (x[t] . c) for routed pairs, 0 for unrouted ones.
    """
    ids = make_ids(11, 3, 5, seed=3, mode="drop")
    meta = routing_metadata(ids, 5, block_m=16)
    g = torch.Generator().manual_seed(2)
    x0 = torch.randn(11, 19, generator=g).to(dtype)
    s0 = torch.rand(11, 3, generator=g).to(dtype)
    c = torch.linspace(-1, 1, 19)
    routed = (ids >= 0).double().numpy()
    x64, s64, c64 = x0.double().numpy(), s0.double().numpy(), c.double().numpy()
    ref_dx = 2.0 * (s64**2 * routed).sum(1, keepdims=True) * c64[None, :]
    ref_ds = 4.0 * s64 * (x64 @ c64)[:, None] * routed
    grads = {}
    for backend in BACKENDS:
        x = x0.clone().requires_grad_()
        s = s0.clone().requires_grad_()
        with force_backend(backend):
            z = permute(x, meta, s)
            out = combine(z * 2.0, meta, s)
            (out.float() * c).sum().backward()
        grads[backend] = (x.grad, s.grad)
        assert rel_err(x.grad, ref_dx) <= 4 * TOL[dtype]
        assert rel_err(s.grad, ref_ds) <= 4 * TOL[dtype]
    for a, b in zip(grads["torch"], grads["triton"], strict=True):
        torch.testing.assert_close(a, b, rtol=TOL[dtype] * 4, atol=TOL[dtype] * 4)


def test_shape_errors():
    meta = routing_metadata(torch.tensor([[0, 1]]), 2)
    with pytest.raises(ReplayError, match=r"x must be \[T=1, H\], got shape \(2, 4\)"):
        permute(torch.zeros(2, 4), meta)
    with pytest.raises(ReplayError, match=r"scale must be \[T, k\]=\[1, 2\], got \(1, 3\)"):
        permute(torch.zeros(1, 4), meta, torch.zeros(1, 3))
    with pytest.raises(ReplayError, match=r"y must be \[R=2, H\], got shape \(3, 4\)"):
        combine(torch.zeros(3, 4), meta, torch.zeros(1, 2))
    with pytest.raises(ReplayError, match=r"weights must be \[T, k\]=\[1, 2\], got \(1, 3\)"):
        combine(torch.zeros(2, 4), meta, torch.zeros(1, 3))
    with pytest.raises(ReplayError, match=r"b must be \[R=2, H=4\], got shape \(2, 5\)"):
        rowdot(torch.zeros(1, 4), torch.zeros(2, 5), meta)
    with pytest.raises(ReplayError, match=r"a must be \[T=1, H\], got shape \(4,\)"):
        rowdot(torch.zeros(4), torch.zeros(2, 4), meta)


@settings(max_examples=12)
@given(
    T=st.integers(0, 50),
    k=st.integers(1, 4),
    S=st.integers(4, 9),
    H=st.integers(1, 70),
    drop=st.sampled_from([0.0, 0.5]),
    seed=st.integers(0, 1000),
)
def test_round_trip_hypothesis(T, k, S, H, drop, seed):
    """combine(permute(x)) = x[t] * (sum of the weights of t's routed pairs), on the Triton path."""
    g = np.random.default_rng(seed)
    ids = np.stack([g.permutation(S)[:k] for _ in range(T)]) if T else np.zeros((0, k), dtype=np.int64)
    ids[g.random((T, k)) < drop] = -1
    meta = routing_metadata(torch.from_numpy(ids), S, block_m=16)
    x = torch.from_numpy(g.standard_normal((T, H))).float()
    w = torch.from_numpy(g.random((T, k))).float()
    with force_backend("triton"):
        out = combine(permute(x, meta), meta, w)
    factor = (w.double().numpy() * (ids >= 0)).sum(1, keepdims=True)
    assert rel_err(out, x.double().numpy() * factor) <= 1e-6


def test_wide_rows_use_several_column_blocks():
    """H above the interpreter's 4096-column block: two column blocks / two rowdot iterations."""
    ids = torch.tensor([[0, 2], [1, -1], [2, 1]])
    meta = routing_metadata(ids, 3, block_m=16)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 4100, generator=g)
    w = torch.rand(3, 2, generator=g)
    with force_backend("triton"):
        xs = permute(x, meta, w)
        out = combine(xs, meta, w)
        dots = rowdot(x, xs, meta)
    with force_backend("torch"):
        torch.testing.assert_close(xs, permute(x, meta, w), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(out, combine(xs, meta, w), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(dots, rowdot(x, xs, meta), rtol=1e-5, atol=1e-4)
