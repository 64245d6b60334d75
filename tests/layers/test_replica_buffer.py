"""LayerSharedReplicaBuffer: r slots per rank whatever the number of layers (a 48-layer model on two
ranks refills one buffer per layer, forward and backward, and matches the unreplicated run), the
paper's memory figures, and the wire order of ReplicaTransfer on a hand-built plan."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from relibra_moe.layers.moe import ReplayBalancedMoE
from relibra_moe.layers.replay import replay
from relibra_moe.layers.replica_buffer import LayerSharedReplicaBuffer, ReplicaTransfer, replica_buffer_bytes
from relibra_moe.layers.testing import kernel_backend, rank_device, run_group
from relibra_moe.plan import ReplicaPlan
from relibra_moe.specs import ModelSpec
from relibra_moe.triton_kernels.backend import force_backend

MIB = 1 << 20


def test_paper_memory_figures():
    assert replica_buffer_bytes("qwen3-30b-a3b", 2) == 18 * MIB
    assert replica_buffer_bytes("qwen3-235b-a22b", 2) == 72 * MIB
    assert replica_buffer_bytes("qwen3-30b-a3b", 2, dtype_bytes=4) == 36 * MIB
    assert replica_buffer_bytes("qwen3-30b-a3b", 0) == 0
    with pytest.raises(ValueError):
        replica_buffer_bytes("no-such-model", 2)
    for bad in (True, -1, 1.5):  # never reinterpreted as a slot count
        with pytest.raises(ValueError, match=f"replica_slots={bad!r} must be an int >= 0"):
            replica_buffer_bytes("qwen3-30b-a3b", bad)


def test_buffer_bytes_match_the_formula():
    buf = LayerSharedReplicaBuffer(64, 48, 3, dtype=torch.bfloat16)
    assert buf.nbytes == replica_buffer_bytes(ModelSpec("t", 64, 48, 8, 2, 48), 3) == 3 * 3 * 64 * 48 * 2


def test_48_layer_model_allocates_r_slots_once():
    buf = LayerSharedReplicaBuffer(8, 12, 2)
    model = torch.nn.ModuleList([ReplayBalancedMoE(8, 12, 4, 2, replica_buffer=buf) for _ in range(48)])
    assert all(layer.replica_buffer is buf for layer in model)
    slot_ptrs = {t.data_ptr() for layer in model for t in layer.replica_buffer.tensors}
    assert len(slot_ptrs) == 2  # one gate/up and one down tensor for the whole model
    assert buf.nbytes == 2 * 3 * 8 * 12 * 4
    # the slots are not module state: nothing per layer in the state dict
    sd = model.state_dict()
    assert not any(v.untyped_storage().data_ptr() in {t.untyped_storage().data_ptr() for t in buf.tensors}
                   for v in sd.values())
    assert not any(v.shape[:1] == (2,) and v.shape[1:] in buf.shapes for v in sd.values())
    assert sum(v.numel() for k, v in model.state_dict().items() if "experts" in k) == 48 * 4 * 3 * 8 * 12


def test_incompatible_buffer_is_rejected():
    buf = LayerSharedReplicaBuffer(8, 12, 2)
    with pytest.raises(ValueError, match="cannot hold"):
        ReplayBalancedMoE(8, 16, 4, 2, replica_buffer=buf)


def test_transfer_wire_order_hand_built():
    # 4 ranks, 2 per node, E = 8, expert e homed on e // 2, r = 2
    home = np.arange(8) // 2
    rep = np.array([[2, -1], [0, 1], [7, -1], [4, 5]])
    t0 = ReplicaTransfer.build(rep, home, rank=0, gpus_per_node=2)
    assert t0.send_local.tolist() == [0, 1] and t0.send_splits == (0, 2, 0, 0)
    assert t0.recv_slots.tolist() == [0] and t0.recv_splits == (0, 1, 0, 0)
    t1 = ReplicaTransfer.build(rep, home, rank=1, gpus_per_node=2)
    assert t1.send_local.tolist() == [0] and t1.send_splits == (1, 0, 0, 0)  # expert 2 = local row 0 of rank 1
    assert t1.recv_slots.tolist() == [0, 1] and t1.recv_splits == (2, 0, 0, 0)
    t3 = ReplicaTransfer.build(rep, home, rank=3, gpus_per_node=2)
    assert t3.send_local.tolist() == [1] and t3.send_splits == (0, 0, 1, 0)  # expert 7 = local row 1
    assert t3.recv_slots.tolist() == [0, 1] and t3.recv_splits == (0, 0, 2, 0)
    assert t0.active and t0.intra_node
    empty = ReplicaTransfer.build(np.full((4, 2), -1), home, rank=2, gpus_per_node=2)
    assert not empty.active and empty.send_local.numel() == 0


LAYERS = 48


def _worker_48(rank: int, world: int) -> None:
    """48 layers share one buffer (r = 1); every layer puts each rank's expert replica on the other rank."""
    torch.manual_seed(0)
    buf = LayerSharedReplicaBuffer(4, 4, 1)
    model = torch.nn.ModuleList([ReplayBalancedMoE(4, 4, 2, 1, replica_buffer=buf) for _ in range(LAYERS)])
    gen = torch.Generator(device=rank_device()).manual_seed(rank)
    with torch.no_grad():
        for layer in model:  # routers equal on both ranks, experts different
            layer.router.weight.copy_(torch.randn(2, 4, generator=torch.Generator(device=rank_device()).manual_seed(1)))
            layer.experts.w_gate_up.copy_(torch.randn(1, 4, 8, generator=gen) * 0.3)
            layer.experts.w_down.copy_(torch.randn(1, 4, 4, generator=gen) * 0.3)
    x = torch.randn(6, 4, generator=gen)
    ids = torch.tensor([[0], [1]] * 3)
    rep = np.zeros((1, LAYERS, 2, 1), np.int32)
    rep[0, :, 0, 0], rep[0, :, 1, 0] = 1, 0
    rows, shares = [], []
    for l in range(LAYERS):
        for j in range(2):
            for e in range(2):
                rows += [(0, l, j, e, 0), (0, l, j, e, 1)]
                shares += [0.5, 0.5]
    plan = ReplicaPlan(rep, np.array(rows), np.array(shares))
    ptrs = [t.data_ptr() for t in buf.tensors]

    def run(p):
        for layer in model:
            layer.zero_grad()
        xi = x.clone().requires_grad_()
        with replay(model, [ids] * LAYERS, plan=p, micro_batch=0):
            h = xi
            for layer in model:
                h = h + 0.5 * layer(h)
        h.square().sum().backward()
        return h.detach(), xi.grad, [t.grad.clone() for t in model.parameters()]

    with force_backend(kernel_backend()):
        ref = run(None)
        fills = buf.fills
        got = run(plan)
    assert buf.fills - fills == LAYERS + LAYERS - 1  # forward fill per layer + backward refill but the last
    assert [t.data_ptr() for t in buf.tensors] == ptrs and buf.nbytes == 1 * 3 * 4 * 4 * 4
    # per source, 3 pairs per expert split 1.5 / 1.5 -> 2 to the lower rank, 1 to the other (largest remainder)
    assert model[0].last_load == (8 if rank == 0 else 4)
    torch.testing.assert_close(got[0], ref[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[1], ref[1], rtol=1e-5, atol=1e-6)
    for a, b in zip(got[2], ref[2]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(120)
def test_48_layers_share_one_buffer_on_two_ranks():
    run_group(_worker_48, 2, timeout_s=60)


def test_bad_buffer_sizes_are_named():
    for bad in (1.5, True, -1):
        with pytest.raises(ValueError, match=f"slots={bad!r} must be an int >= 0"):
            LayerSharedReplicaBuffer(8, 12, bad)
    with pytest.raises(ValueError, match="hidden=0 must be an int >= 1"):
        LayerSharedReplicaBuffer(0, 12, 1)
