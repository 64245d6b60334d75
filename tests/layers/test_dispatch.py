"""Dispatchers: the local one is the identity; the all-to-all one moves rows to their destinations
in (source, sender order), combine is its exact inverse, both are differentiable (the backward of a
dispatch is a combine), metadata and intra-node replica traffic go where they should; DeepEP is
exercised only where it is installed with CUDA."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from relibra_moe.layers.dispatch import (
    AllToAllDispatcher,
    DeepEPDispatcher,
    Dispatcher,
    LocalDispatcher,
    get_dispatcher,
    has_deep_ep,
)
from relibra_moe.layers.moe import ReplayBalancedMoE
from relibra_moe.layers.testing import run_group


def test_local_dispatcher_is_identity():
    d = LocalDispatcher()
    assert isinstance(d, Dispatcher)
    x = torch.randn(5, 3, requires_grad=True)
    y = d.combine(d.dispatch(x, [5], [5]), [5], [5])
    assert torch.equal(y, x)
    meta = torch.tensor([[4, 0]])
    assert torch.equal(d.exchange(meta), meta)
    assert isinstance(get_dispatcher(None), LocalDispatcher)


def test_get_dispatcher_rejects_unknown_kind():
    with pytest.raises(ValueError, match="dispatcher kind"):
        get_dispatcher(None, kind="nccl-magic")


@pytest.mark.skipif(not (has_deep_ep() and torch.cuda.is_available()),
                    reason="DeepEPDispatcher needs the optional deep_ep package and CUDA GPUs")
def test_deepep_dispatcher_available():  # pragma: no cover - GPU only
    assert issubclass(DeepEPDispatcher, AllToAllDispatcher)


def test_deepep_dispatcher_without_deep_ep_says_why():
    if has_deep_ep():
        pytest.skip("deep_ep is installed")
    with pytest.raises(RuntimeError, match="deep_ep"):
        DeepEPDispatcher()


def _worker(rank: int, world: int) -> None:
    d = get_dispatcher(None, gpus_per_node=2)
    assert isinstance(d, AllToAllDispatcher) and d.rank == rank and d.node == rank // 2
    # rank j sends (j + 1) * (g + 1) % 3 rows to rank g; row value encodes (source, dest, index)
    send_splits = [(rank + 1) * (g + 1) % 3 for g in range(world)]
    recv_splits = [(j + 1) * (rank + 1) % 3 for j in range(world)]
    rows = [[rank, g, i] for g in range(world) for i in range(send_splits[g])]
    x = torch.tensor(rows, dtype=torch.float64).reshape(-1, 3).requires_grad_()
    meta = d.exchange(torch.tensor([[s, 7 * rank] for s in send_splits]))
    assert meta[:, 0].tolist() == recv_splits and meta[:, 1].tolist() == [7 * j for j in range(world)]
    y = d.dispatch(x, send_splits, recv_splits)
    want = [[j, rank, i] for j in range(world) for i in range(recv_splits[j])]
    assert y.detach().reshape(-1, 3).tolist() == want
    back = d.combine(y * 2.0, send_splits, recv_splits)
    assert torch.equal(back.detach(), 2.0 * x.detach())
    (back * torch.arange(back.numel(), dtype=torch.float64).reshape(back.shape)).sum().backward()
    assert torch.equal(x.grad, 2.0 * torch.arange(x.numel(), dtype=torch.float64).reshape(x.shape))
    ids = d.dispatch_ids(torch.tensor([g for g in range(world) for _ in range(send_splits[g])]), send_splits,
                         recv_splits)
    assert ids.tolist() == [rank] * sum(recv_splits)
    # intra-node replica traffic: each rank sends one row to its node peer only
    peer = rank ^ 1
    s = [1 if g == peer else 0 for g in range(world)]
    got = d.replica_exchange(torch.full((1, 2), float(rank)), s, s, intra_node=True)
    assert got.tolist() == [[float(peer), float(peer)]]
    with pytest.raises(ValueError, match="another node"):
        far = [1 if g == (rank + 2) % world else 0 for g in range(world)]
        d.replica_exchange(torch.zeros(1, 2), far, far, intra_node=True)
    _ep_subgroups(rank, world)
    dist.barrier()


def _ep_subgroups(rank: int, world: int) -> None:
    """Two EP groups of 2 ranks inside a world of 4 (one node per rank): a plain EP layer in each group
    equals the same layer computed densely on one rank (the group's tokens, the group's experts)."""
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    ep = groups[rank // 2]
    torch.manual_seed(5)  # every rank draws the same full weights and tokens
    w1, w2, wr = torch.randn(4, 6, 16) * 0.3, torch.randn(4, 8, 6) * 0.3, torch.randn(4, 6)
    xs = torch.randn(4, 3, 6)  # 3 tokens per rank
    layer = ReplayBalancedMoE(6, 8, 4, 2, ep_group=ep, gpus_per_node=1)
    assert layer.world_size == 2 and layer.rank == rank % 2
    with torch.no_grad():
        mine = layer.home_experts
        layer.experts.w_gate_up.copy_(w1[mine])
        layer.experts.w_down.copy_(w2[mine])
        layer.router.weight.copy_(wr)
    out = layer(xs[rank])
    dense = ReplayBalancedMoE(6, 8, 4, 2, dispatcher=LocalDispatcher())
    with torch.no_grad():
        dense.experts.w_gate_up.copy_(w1)
        dense.experts.w_down.copy_(w2)
        dense.router.weight.copy_(wr)
    torch.testing.assert_close(out, dense(xs[rank]), rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(90)
def test_all_to_all_dispatcher_four_ranks():
    run_group(_worker, 4, timeout_s=60)
