"""relayout: expert parameters, gradients and AdamW state move to the new homes (checked per logical
expert across ranks), the layer computes the same function afterwards, and relayout followed by the
inverse relayout is a bitwise identity. Bad placements (on any rank) and placements that differ between
ranks raise PlanError on every rank before any expert moves."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

from relibra_moe.errors import PlanError
from relibra_moe.layers.moe import ReplayBalancedMoE
from relibra_moe.layers.relayout import relayout
from relibra_moe.layers.replay import replay
from relibra_moe.layers.testing import kernel_backend, rank_device, run_group
from relibra_moe.plan import Placement
from relibra_moe.triton_kernels.backend import force_backend

H, FF, K, L = 6, 10, 2, 2


def _full(layer: ReplayBalancedMoE, t: torch.Tensor) -> torch.Tensor:
    """The [E, ...] tensor indexed by logical expert, assembled from every rank's rows."""
    parts = [torch.empty_like(t) for _ in range(layer.world_size)]
    dist.all_gather(parts, t.contiguous())
    out = torch.empty((layer.num_experts,) + tuple(t.shape[1:]), dtype=t.dtype)
    home = layer.expert_gpu_host
    for g in range(layer.world_size):
        out[np.flatnonzero(home == g)] = parts[g]
    return out


def _snapshot(layers, opt) -> list[torch.Tensor]:
    out = []
    for layer in layers:
        for p in layer.experts.expert_tensors():
            st = opt.state[p]
            out += [p.detach().clone(), p.grad.clone(), st["exp_avg"].clone(), st["exp_avg_sq"].clone(),
                    st["step"].clone()]
    return out


def _logical(layers, opt) -> list[torch.Tensor]:
    out = []
    for layer in layers:
        for p in layer.experts.expert_tensors():
            st = opt.state[p]
            out += [_full(layer, t) for t in (p.detach(), p.grad, st["exp_avg"], st["exp_avg_sq"])]
    return out


def _worker(rank: int, world: int, P: int, E: int, biased: bool = False) -> None:
    from relibra_moe.layers.experts import BiasedGatedExperts

    torch.manual_seed(100 + rank)
    layers = torch.nn.ModuleList([
        ReplayBalancedMoE(H, FF, E, K, gpus_per_node=P,
                          experts=BiasedGatedExperts(H, FF, E // world, activation="gpt_oss") if biased else None)
        for _ in range(L)])
    assert all(len(layer.experts.expert_tensors()) == (4 if biased else 2) for layer in layers)
    for layer in layers:  # routers equal on every rank (data-parallel copies)
        dist.broadcast(layer.router.weight.data, 0)
    opt = torch.optim.AdamW(layers.parameters(), lr=1e-2)
    x = torch.randn(5, H)
    gen = torch.Generator(device=rank_device()).manual_seed(7 + rank)
    ids = [torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(5)]) for _ in range(L)]

    def run():
        with replay(layers, ids):
            h = x
            for layer in layers:
                h = h + layer(h)
        return h

    with force_backend(kernel_backend()):
        for _ in range(2):
            opt.zero_grad()
            run().pow(2).sum().backward()
            opt.step()
        run().pow(2).sum().backward()  # grads present during relayout
        before_out = run().detach()
        before = _snapshot(layers, opt)
        before_logical = _logical(layers, opt)

        rng = np.random.default_rng(3)  # same on every rank
        new = np.stack([rng.permutation(np.arange(E) // (E // world)) for _ in range(L)])
        info = relayout(layers, Placement(new), opt)
        assert info["layers_changed"] == sum(not np.array_equal(new[l], np.arange(E) // (E // world))
                                             for l in range(L))
        for l, layer in enumerate(layers):
            assert np.array_equal(layer.expert_gpu_host, new[l])
        after_logical = _logical(layers, opt)
        for a, b in zip(before_logical, after_logical):
            assert torch.equal(a, b)  # every expert's rows of weight, grad, exp_avg, exp_avg_sq moved intact
        torch.testing.assert_close(run().detach(), before_out, rtol=1e-6, atol=1e-6)

        relayout(layers, Placement.static(L, E, world), opt)
        for a, b in zip(before, _snapshot(layers, opt)):
            assert torch.equal(a, b)  # inverse relayout: bitwise identity

        bad = new.copy()
        bad[1, :3] = 0  # GPU 0 homes too many experts in layer 1 (on every rank)
        if rank == 0:
            bad[1, :] = 0
        with pytest.raises(PlanError, match="layer 1"):
            relayout(layers, bad, opt)
        with pytest.raises(PlanError, match="MoE layers"):
            relayout(layers, new[:1], opt)
        opt.step()  # the optimizer still works after the moves
        relayout(layers, new, opt)  # and the group is still usable after the errors


@pytest.mark.timeout(120)
def test_relayout_two_ranks():
    run_group(_worker, 2, 2, 4, timeout_s=60)


@pytest.mark.timeout(120)
def test_relayout_moves_biased_experts():
    """GPT-OSS-style experts (weights and biases, four tensors per expert): all four, with their grads
    and AdamW state, move and come back bitwise."""
    run_group(_worker, 2, 2, 4, True, timeout_s=60)


def test_relayout_single_rank_validates():
    layer = ReplayBalancedMoE(H, FF, 4, K)
    assert relayout(layer, np.zeros((1, 4), np.int64)) == {"layers_changed": 0, "experts_moved": 0}
    with pytest.raises(PlanError, match="outside"):
        relayout(layer, np.ones((1, 4), np.int64))


def test_relayout_rejects_non_integer_placements():
    layer = ReplayBalancedMoE(H, FF, 4, K)
    with pytest.raises(PlanError, match=r"integer GPU ids: expert_gpu\[0, 2\] = 0.5 \(dtype float64\)"):
        relayout(layer, np.array([[0, 0, 0.5, 0]]))
    with pytest.raises(PlanError, match="dtype bool"):
        relayout(layer, np.zeros((1, 4), bool))
    assert relayout(layer, np.zeros((1, 4)))["layers_changed"] == 0  # integral floats are GPU ids
    with pytest.raises(PlanError, match=r"shape \(4,\)"):
        relayout(layer, np.zeros(4, np.int64))


def _disagree_worker(rank: int, world: int) -> None:
    torch.manual_seed(0)
    layer = ReplayBalancedMoE(H, FF, 4, K)
    before = [t.detach().clone() for t in layer.experts.expert_tensors()]
    swapped = np.array([[1, 1, 0, 0]])
    cases = [
        (swapped if rank == 0 else np.array([[1, 0, 1, 0]]), "different placements"),  # valid, but differ
        (swapped if rank == 0 else np.array([[0, 0, 0, 1]]),  # rank 1's is invalid
         "rank 1 of the EP group rejected" if rank == 0 else "GPU 0 homes 3 experts"),
    ]
    for grid, match in cases:
        with pytest.raises(PlanError, match=match):
            relayout(layer, grid)
        assert layer.expert_gpu_host.tolist() == [0, 0, 1, 1]  # nothing moved
        for t, b in zip(layer.experts.expert_tensors(), before):
            assert torch.equal(t, b)
    assert relayout(layer, swapped) == {"layers_changed": 1, "experts_moved": 4}  # the group still works


@pytest.mark.timeout(120)
def test_relayout_bad_or_different_placements_raise_on_every_rank():
    run_group(_disagree_worker, 2, timeout_s=30)
