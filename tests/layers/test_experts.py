"""Expert containers as ordered sets of per-expert tensors: BiasedGatedExperts (SwiGLU and GPT-OSS's
clamped interleaved activation) with replica slots against float64 per-row loops, gradients of every
tensor (home and slot) against autograd of that loop; the replica buffer sized for any set; the layer
with an ``experts=`` container."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from relibra_moe.layers.experts import BiasedGatedExperts, GroupedSwiGLUExperts, gpt_oss_activation
from relibra_moe.layers.moe import ReplayBalancedMoE
from relibra_moe.layers.replica_buffer import LayerSharedReplicaBuffer
from relibra_moe.triton_kernels.backend import force_backend

H, FF = 8, 6


def _loop_expert(x: torch.Tensor, w1, b1, w2, b2, kind: str, alpha=1.702, limit=7.0) -> torch.Tensor:
    """One expert on one row, written out (float64)."""
    h = x @ w1 + b1
    if kind == "gpt_oss":
        gate, up = h[0::2], h[1::2]
        gate = torch.minimum(gate, torch.tensor(limit, dtype=h.dtype))
        up = torch.clamp(up, -limit, limit)
        a = (up + 1) * gate / (1 + torch.exp(-alpha * gate))
    else:
        a = F.silu(h[:FF]) * h[FF:]
    return a @ w2 + b2


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("kind", ["swiglu", "gpt_oss"])
def test_biased_experts_with_replica_slots_equal_a_row_loop(kind, backend):
    """Through the torch reference and the Triton kernels (interpreter on CPU)."""
    from relibra_moe.triton_kernels.backend import INTERPRET

    if backend == "triton" and not INTERPRET:
        pytest.skip("TRITON_INTERPRET=1 was not set before triton was imported")
    torch.manual_seed(3)
    # limit 0.5 so the clamps bind on some entries
    ex = BiasedGatedExperts(H, FF, 3, activation=kind, alpha=1.5, limit=0.5, block_m=16)
    assert ex.tensor_names == ("w_gate_up", "b_gate_up", "w_down", "b_down") and ex.num_local == 3
    home = [t.detach().clone().requires_grad_() for t in ex.expert_tensors()]
    slots = [torch.randn((2,) + tuple(t.shape[1:])).mul_(0.5).requires_grad_() for t in home]
    x = torch.randn(23, H, requires_grad=True)
    slot_ids = torch.tensor([0, 4, 4, 1, 3, 0, 4, 2, 3, 3, 0, 1, 4, 4, 2, 0, 3, 1, 1, 4, 0, 2, 3])
    dy = torch.randn(23, H)
    with force_backend(backend):
        y = ex.compute_tensors(x, slot_ids, home, slots)
        (y * dy).sum().backward()

    hd = [t.detach().double().requires_grad_() for t in home]
    sd = [t.detach().double().requires_grad_() for t in slots]
    xd = x.detach().double().requires_grad_()
    rows = []
    for i, s in enumerate(slot_ids.tolist()):
        ws = [t[s] for t in hd] if s < 3 else [t[s - 3] for t in sd]
        rows.append(_loop_expert(xd[i], *ws, kind, alpha=1.5, limit=0.5))
    ref = torch.stack(rows)
    (ref * dy.double()).sum().backward()
    torch.testing.assert_close(y.detach().double(), ref.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x.grad.double(), xd.grad, rtol=1e-5, atol=1e-6)
    for got, want in zip(home + slots, hd + sd):
        torch.testing.assert_close(got.grad.double(), want.grad, rtol=1e-5, atol=1e-6)
    if kind == "gpt_oss":  # the clamps did bind somewhere
        h = torch.stack([xd[i] @ (hd[0][s] if s < 3 else sd[0][s - 3]) for i, s in enumerate(slot_ids.tolist())])
        assert (h[:, 0::2] > 0.5).any() and (h[:, 1::2].abs() > 0.5).any()


def test_gpt_oss_activation_is_hf():
    transformers = pytest.importorskip("transformers")
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    cfg = transformers.GptOssConfig(hidden_size=8, intermediate_size=6, num_local_experts=2, swiglu_limit=0.7)
    hf = GptOssExperts(cfg)
    h = torch.randn(5, 12) * 2
    torch.testing.assert_close(gpt_oss_activation(hf.alpha, hf.limit)(h), hf._apply_gate(h), rtol=0, atol=0)


def test_replica_buffer_for_any_expert_set():
    ex = BiasedGatedExperts(H, FF, 2, dtype=torch.float64)
    buf = LayerSharedReplicaBuffer.for_experts(ex, 3)
    assert buf.names == ex.tensor_names and buf.dtype == torch.float64
    assert buf.shapes == ((H, 2 * FF), (2 * FF,), (FF, H), (H,))
    assert buf.nbytes == 3 * 8 * (H * 2 * FF + 2 * FF + FF * H + H)
    assert buf.b_down.shape == (3, H) and buf.w_gate_up.shape == (3, H, 2 * FF)
    buf.check_experts(ex.expert_tensors())
    with pytest.raises(ValueError, match="cannot hold"):
        buf.check_experts(GroupedSwiGLUExperts(H, FF, 2, dtype=torch.float64).expert_tensors())
    with pytest.raises(AttributeError):
        buf.no_such_member  # noqa: B018
    # the default set is SwiGLU's two matrices, readable by their names
    two = LayerSharedReplicaBuffer(H, FF, 2)
    assert two.names == ("w_gate_up", "w_down") and two.w_down.shape == (2, FF, H)


def test_layer_with_an_experts_container():
    torch.manual_seed(0)
    ex = BiasedGatedExperts(H, FF, 4, activation="gpt_oss")
    layer = ReplayBalancedMoE(H, FF, 4, 2, experts=ex)
    assert layer.experts is ex
    x = torch.randn(9, H)
    with force_backend("torch"):
        y = layer(x)
    ids, gates = layer.last_routing, torch.softmax(layer.router.weight.detach() @ x.T, 0).T
    gates = torch.gather(gates, 1, ids)
    gates = gates / gates.sum(1, keepdim=True) if layer.router.renormalize else gates
    ws = [t.detach() for t in ex.expert_tensors()]
    ref = torch.stack([sum(gates[t, j] * _loop_expert(x[t], *[w[ids[t, j]] for w in ws], "gpt_oss")
                           for j in range(2)) for t in range(9)])
    torch.testing.assert_close(y.detach(), ref, rtol=1e-5, atol=1e-6)
    y.sum().backward()
    assert all(t.grad is not None and t.grad.abs().sum() > 0 for t in ex.expert_tensors())
    with pytest.raises(ValueError, match="num_experts / G"):
        ReplayBalancedMoE(H, FF, 8, 2, experts=BiasedGatedExperts(H, FF, 4))
    with pytest.raises(ValueError, match="cannot hold"):
        ReplayBalancedMoE(H, FF, 4, 2, experts=BiasedGatedExperts(H, FF, 4),
                          replica_buffer=LayerSharedReplicaBuffer(H, FF, 1))


# ----------------------------------------------------------------------------- the CPU reference's fused stage


def _fused_case(dtype: torch.dtype, pad: bool):
    """Experts, rows, gates and a routing with (``pad``) an unrouted pair and a token with no expert."""
    from relibra_moe.triton_kernels.routing import routing_metadata

    torch.manual_seed(5)
    T, k, E, Hd, F2 = 9, 2, 4, 16, 8
    ex = GroupedSwiGLUExperts(Hd, F2, E, dtype=dtype)
    ids = torch.stack([torch.randperm(E)[:k] for _ in range(T)])
    ids[:3, 0] = 2  # a crowded expert
    if pad:
        ids[4, 1] = -1
        ids[7] = -1
    x = torch.randn(T, Hd, dtype=dtype)
    gates = torch.rand(T, k)
    return ex, ids, x, gates, routing_metadata(ids, E, block_m=4)


def _float64_loop(ex, ids, x, gates):
    """sum_j gates[t, j] * swiglu(x[t] W1[e]) W2[e] over the routed pairs, in float64."""
    w1, w2 = (w.detach().double() for w in (ex.w_gate_up, ex.w_down))
    out = torch.zeros(x.shape, dtype=torch.float64)
    F2 = w2.shape[1]
    for t in range(ids.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if e >= 0:
                h = x[t].double() @ w1[e]
                out[t] += float(gates[t, j]) * ((F.silu(h[:F2]) * h[F2:]) @ w2[e])
    return out


@pytest.mark.parametrize("pad", [False, True])
def test_reference_local_experts_equals_the_kernel_ops_and_a_float64_loop(pad):
    """The fused CPU stage (gather, torch._grouped_mm, combine as plain ops) gives the custom kernel ops' output
    and gradients (x, both weights, gates) and the float64 loop's output; padding rows and unrouted pairs
    contribute nothing (also with the undefined rows torch._grouped_mm leaves past the last slot)."""
    from relibra_moe.layers.experts import local_rows, reference_local_experts
    from relibra_moe.triton_kernels.grouped_gemm import swiglu, swiglu_experts
    from relibra_moe.triton_kernels.permute import combine, permute

    ex, ids, x, gates, meta = _fused_case(torch.float32, pad)
    rows = local_rows(meta, all_routed=not pad)
    assert rows.all_routed is (not pad)
    results = []
    for fused in (True, False):
        ex.zero_grad()
        xr, gr = x.clone().requires_grad_(), gates.clone().requires_grad_()
        with force_backend("torch"):
            if fused:
                out = reference_local_experts(xr, rows, ex.w_gate_up, ex.w_down, swiglu, gr)
            else:
                out = combine(swiglu_experts(permute(xr, meta), meta, ex.w_gate_up, ex.w_down), meta, gr)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        results.append([out.detach(), xr.grad, gr.grad, ex.w_gate_up.grad.clone(), ex.w_down.grad.clone()])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(results[0][0].double(), _float64_loop(ex, ids, x, gates), rtol=1e-5, atol=1e-6)
    if pad:
        assert torch.equal(results[0][0][7], torch.zeros(x.shape[1]))  # the token with no expert
        assert torch.equal(results[0][1][7], torch.zeros(x.shape[1]))
        assert float(results[0][2][4, 1]) == 0.0


def test_reference_local_experts_in_bf16_and_where_grouped_mm_does_not_fit():
    from relibra_moe.layers.experts import grouped_mm_fits, local_rows, reference_local_experts
    from relibra_moe.triton_kernels.grouped_gemm import swiglu

    ex, ids, x, gates, meta = _fused_case(torch.bfloat16, True)
    assert grouped_mm_fits(ex.w_gate_up, ex.w_down)
    out = reference_local_experts(x, local_rows(meta), ex.w_gate_up, ex.w_down, swiglu, gates)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), _float64_loop(ex, ids, x, gates), rtol=2e-2, atol=2e-2)
    assert not grouped_mm_fits(ex.w_gate_up.double(), ex.w_down.double())  # no float64 kernel
    assert not grouped_mm_fits(torch.zeros(2, 6, 8), torch.zeros(2, 4, 6))  # 24-byte rows
    assert not grouped_mm_fits(ex.w_gate_up, ex.w_down.float())  # mixed dtypes
    assert grouped_mm_fits(torch.zeros(2, 8, 16).transpose(1, 2), torch.zeros(2, 8, 8))  # HF's transposed views


def test_reference_local_experts_with_no_routed_pair_is_zero_with_finite_gradients():
    """Every pair unrouted (a placeholder forward): torch._grouped_mm computes no row, the output and every
    gradient are exact zeros (no undefined row reaches them)."""
    from relibra_moe.layers.experts import local_rows, reference_local_experts
    from relibra_moe.triton_kernels.grouped_gemm import swiglu
    from relibra_moe.triton_kernels.routing import routing_metadata

    ex = GroupedSwiGLUExperts(16, 8, 4)
    x, gates = torch.randn(5, 16, requires_grad=True), torch.rand(5, 2, requires_grad=True)
    meta = routing_metadata(torch.full((5, 2), -1), 4, block_m=4)
    out = reference_local_experts(x, local_rows(meta), ex.w_gate_up, ex.w_down, swiglu, gates)
    out.sum().backward()
    for t in (out, x.grad, gates.grad, ex.w_gate_up.grad, ex.w_down.grad):
        assert torch.equal(t, torch.zeros_like(t))
