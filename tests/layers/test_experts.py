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
